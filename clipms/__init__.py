"""clipms: CLIP in MindSpore. The library imports nothing from DVC, Prefect, MLflow or stages/.

How MindSpore runs (device, mode, CPU tuning, kernel fusion) is set by `clipms.runtime.configure`;
only MindSpore's log level, which is device-independent and read at import, is set here.
"""

import os

os.environ.setdefault("GLOG_v", "3")  # MindSpore's C++ INFO/WARNING chatter buries real messages

__version__ = "0.1.0"
