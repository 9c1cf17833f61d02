"""The page template of `dvc plots show`, with vega inline, so that the page draws offline.

DVC's own page loads vega, vega-lite and vega-embed from a CDN (cdn.jsdelivr.net): without the
internet its plots stay blank. DVC takes an HTML template instead (`plots.html_template` in
.dvc/config, or `dvc plots show --html-template`): this module writes one that carries the three
libraries in <script> elements of its own and has no `{scripts}` placeholder, which is where DVC
would put its CDN <script src> tags. The libraries come from the npm registry at `make env`
(ops/vega/package.json and its lock, installed into build/vega/, git-ignored):

    npm ci --prefix build/vega            # after copying ops/vega/package*.json there
    python -m ops.plots_page         # -> build/vega/dvc-plots.html

Without npm's files the template is still written, without them and with DVC's `{scripts}`
placeholder: `dvc plots show` then works as DVC's default does (online only) and says so on the
page.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "build" / "vega"
TEMPLATE = BUILD / "dvc-plots.html"
# In the order they must load: vega-lite and vega-embed expect the globals of the ones before.
LIBRARIES = ("vega/build/vega.min.js", "vega-lite/build/vega-lite.min.js",
             "vega-embed/build/vega-embed.min.js")
SOURCE_MAP = re.compile(r"^//# sourceMappingURL=.*$", re.MULTILINE)

PAGE = """<!DOCTYPE html>
<html>
<head>
    <meta charset="utf-8">
    {refresh_tag}
    <title>DVC Plot</title>
{libraries}
    <style>
        table {{
            border-spacing: 15px;
        }}
    </style>
</head>
<body>
{notice}
    {plot_divs}
</body>
</html>
"""
ONLINE_NOTICE = ("    <p><em>vega is loaded from its CDN (npm's vega packages were not installed: "
                 "run <code>make env</code> with npm on the PATH); offline this page stays "
                 "blank.</em></p>")


def inline_script(source: str) -> str:
    """A library as an inline <script>: its source map comment dropped (the page would point to
    a file it does not have) and any `</script` escaped so that it cannot end the element."""
    body = SOURCE_MAP.sub("", source).replace("</script", "<\\/script")
    return f"    <script>\n{body}\n    </script>"


def page(node_modules: Path) -> str:
    """The template: the libraries inline when all three are installed, else DVC's placeholder
    for its CDN <script> tags and a notice on the page."""
    files = [node_modules / name for name in LIBRARIES]
    if all(f.is_file() for f in files):
        libraries = "\n".join(inline_script(f.read_text(encoding="utf8")) for f in files)
        notice = ""
    else:
        libraries, notice = "    {scripts}", ONLINE_NOTICE
    # {refresh_tag} and {plot_divs} are DVC's placeholders: kept as they are.
    return PAGE.format(refresh_tag="{refresh_tag}", plot_divs="{plot_divs}",
                       libraries=libraries, notice=notice)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--node-modules", type=Path, default=BUILD / "node_modules")
    parser.add_argument("--out", type=Path, default=TEMPLATE)
    args = parser.parse_args(argv)
    text = page(args.node_modules)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf8")
    offline = "{scripts}" not in text
    print(f"{args.out}: the page of `dvc plots show`, "
          + ("vega inline (draws offline)" if offline else
             f"vega from its CDN: no vega packages in {args.node_modules}"),
          file=sys.stderr if not offline else sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
