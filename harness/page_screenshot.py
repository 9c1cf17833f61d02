"""Screenshot of a real search on a running service's page (for docs/search-page.png).

    make serve &                     # the default run's champion on 127.0.0.1:8000
    python -m harness.page_screenshot --url http://127.0.0.1:8000 --query "a red circle" \
        --out docs/search-page.png

Drives headless Chromium like tests/serving/test_app.py: types the query, waits until every result
image has loaded, and saves the page.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from harness.webdriver import Browser

LOADED = """const cards = [...document.querySelectorAll('.result')];
return cards.length > 0 && cards.every(c => c.querySelector('img').complete
                                            && c.querySelector('img').naturalWidth > 0)"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--query", default="a red circle")
    p.add_argument("--out", type=Path, default=Path("docs/search-page.png"))
    p.add_argument("--size", default="1200x900", help="window WIDTHxHEIGHT")
    args = p.parse_args()
    width, height = (int(v) for v in args.size.split("x"))
    with Browser(window=(width, height)) as browser:
        browser.get(args.url.rstrip("/") + "/")
        browser.wait(lambda: " v" in browser.text(browser.find("#model")), what="the model line")
        browser.type(browser.find("#query"), args.query + "\n")
        browser.wait(lambda: browser.script(LOADED), timeout=60, what="the result images")
        browser.screenshot(args.out)
    print(f"{args.out}: {args.query!r} on {args.url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
