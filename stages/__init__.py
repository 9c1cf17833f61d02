"""DVC stage scripts: `python -m stages.<name>` reads its params section, calls the library,
writes its outs."""
