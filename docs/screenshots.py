"""Remake the README's pictures of ``qkv inspect``: its head view and model view, as a browser shows them.

    PYTHONPATH=src python docs/screenshots.py            # writes docs/images/inspect_*.png

Runs ``qkv inspect`` on the packaged MiniLM, opens the page in headless Chromium
(``tests/headless.py``), clicks "it" in layer 5, head 11 (the head whose "it" looks most at
"cat") and photographs the two views. The PNGs are reduced to a 256-colour palette, which
keeps them small without visible loss on a page of flat colours.
"""

from __future__ import annotations

import io
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import headless  # noqa: E402

SENTENCE = "The cat sat on the mat because it was tired."
LAYER, HEAD, TOKEN = 5, 11, 8  # "it"


def _save(png: bytes, path: Path) -> None:
    from PIL import Image

    image = Image.open(io.BytesIO(png)).convert("RGB")
    image.quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)
    print(f"wrote {path} ({image.width} x {image.height}, {path.stat().st_size // 1024} KiB)")


def main() -> int:
    reason = headless.missing()
    if reason:
        print(f"screenshots: {reason}", file=sys.stderr)
        return 1
    from selenium.webdriver.common.by import By

    from qkv.inspect import inspect

    images = ROOT / "docs" / "images"
    with tempfile.TemporaryDirectory() as out:
        inspect(SENTENCE, layer=LAYER, head=HEAD, out=out, echo=lambda line: None)
        driver = headless.start(width=1000, height=1400)
        try:
            driver.get((Path(out) / "index.html").as_uri())
            errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
            if errors:
                print(f"screenshots: the page logged errors: {errors}", file=sys.stderr)
                return 1
            driver.find_element(By.CSS_SELECTOR, f'#lines text[data-row="{TOKEN}"]').click()
            _save(driver.find_element(By.ID, "head-view").screenshot_as_png, images / "inspect_head_view.png")
            _save(driver.find_element(By.ID, "model-view").screenshot_as_png, images / "inspect_model_view.png")
        finally:
            headless.stop(driver)
    return 0


if __name__ == "__main__":
    sys.exit(main())
