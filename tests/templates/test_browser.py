"""The built-in ``browser`` template: Playwright drives Debian's chromium inside a sandbox.

The page is served from inside the sandbox (python's http.server on 127.0.0.1): nothing leaves
the machine. Building the template is the fixture's cost, paid once per host: it installs
chromium from Debian's archive and Playwright from PyPI (the package-install exception for the
built-in images; ``scripts/bootstrap install`` builds it ahead), later runs find every step in
the layer cache.
"""

from __future__ import annotations

import struct
import time
import zlib
from pathlib import Path

import pytest

from tests.conftest import ROOT, cli
from warmbox.engine import resolve
from warmbox.templates.builtins import CHROMIUM

pytestmark = [pytest.mark.sandbox, pytest.mark.browser]

W, H = 640, 400
BACKGROUND = (0x12, 0x34, 0x56)
BOX = (0xFF, 0x88, 0x00)  # painted by the page's script: the pixel proves JavaScript ran
PAGE = """<!doctype html>
<html><head><title>warmbox browser</title></head>
<body style="margin:0;background:#123456">
<div id="box" style="position:absolute;left:400px;top:200px;width:200px;height:150px"></div>
<h1 style="margin:20px;color:#ffffff;font-family:'Liberation Sans',sans-serif">Hello from a sandbox</h1>
<script>document.getElementById("box").style.background = "#ff8800";</script>
</body></html>
"""
SHOT = f"""
import sys
from playwright.sync_api import sync_playwright
with sync_playwright() as p:
    browser = p.chromium.launch(executable_path={CHROMIUM!r})
    page = browser.new_page(viewport={{"width": {W}, "height": {H}}})
    page.goto("http://127.0.0.1:" + sys.argv[1] + "/", wait_until="load")
    page.screenshot(path="/workspace/shot.png")
    print(page.title(), "|", browser.version)
    browser.close()
"""


def png_pixels(data: bytes) -> tuple[int, int, list[bytes]]:
    """(width, height, rows of RGB bytes) of an 8-bit RGB or RGBA, non-interlaced PNG."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, head = 8, b"", None
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            head = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
    assert head is not None
    width, height, depth, color, _, _, interlace = head
    assert depth == 8 and color in (2, 6) and interlace == 0, head
    bpp = 3 if color == 2 else 4
    raw, stride, rows, prev = zlib.decompress(idat), width * bpp, [], bytes(width * bpp)
    for y in range(height):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        prev = bytes(line)
        rows.append(bytes(v for x in range(width) for v in line[x * bpp : x * bpp + 3]))
    return width, height, rows


def pixel(rows: list[bytes], x: int, y: int) -> tuple[int, int, int]:
    r, g, b = rows[y][3 * x : 3 * x + 3]
    return (r, g, b)


@pytest.fixture(scope="module")
def browser_template(home: Path, runc_ready: None) -> str:
    """The built-in browser template, built in this home (layer cache: seconds after the host's first build)."""
    t0 = time.monotonic()
    r = cli("template", "build", "browser", timeout=1800)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    print(f"browser template build: {time.monotonic() - t0:.1f} s")
    return "browser"


@pytest.mark.parametrize("tier", ["container", "gvisor"])
def test_playwright_screenshots_a_page_served_inside_the_sandbox(browser_template: str, home: Path, tier: str):
    from warmbox import Limits, Sandbox

    # chromium (browser, GPU, network, renderer processes) uses ~135 threads: the default limits
    # (512 MiB, 256 pids) hold it on both tiers (gVisor counts them in the Sentry's own pids cgroup;
    # the host threads that serve them have a bound of their own)
    with Sandbox.create(tier=tier, template=browser_template, timeout=300, limits=Limits()) as sb:
        sb.files.write("/workspace/www/index.html", PAGE)
        sb.files.write("/workspace/shot.py", SHOT)
        server = sb.commands.run(
            "exec python3 -m http.server 8765 --bind 127.0.0.1 --directory /workspace/www", background=True
        )
        probe = "import urllib.request as u; print(u.urlopen('http://127.0.0.1:8765/').status)"
        for _ in range(100):
            if sb.commands.run(["python3", "-c", probe], timeout=30).stdout.strip() == "200":
                break
            time.sleep(0.1)
        r = sb.commands.run(["python3", "/workspace/shot.py", "8765"], timeout=180)
        assert r.exit_code == 0, r.stderr[-3000:]
        title, version = (s.strip() for s in r.stdout.split("|"))
        assert title == "warmbox browser" and version.split(".")[0].isdigit(), r.stdout
        png = sb.files.read("/workspace/shot.png", format="bytes")
        server.kill()
    out = ROOT / "bench-results"
    out.mkdir(exist_ok=True)
    (out / f"browser-{tier}.png").write_bytes(png)
    width, height, rows = png_pixels(png)
    assert (width, height) == (W, H)
    assert pixel(rows, 5, H - 5) == BACKGROUND
    assert pixel(rows, 500, 275) == BOX

    # the heading's glyphs: a font rendered white-ish pixels in its band, none below it
    def bright(y0: int, y1: int) -> int:
        return sum(1 for y in range(y0, y1) for x in range(400) if min(pixel(rows, x, y)) > 200)

    assert bright(20, 80) > 200
    assert bright(120, 180) == 0


def test_a_pool_claim_compares_the_image_a_launch_runs(browser_template: str, home: Path):
    """A claim reads the image id from the template's record (no layer lookup): the very id a cold
    launch's ImageRef carries, for the built-in image and for a built template."""
    from warmbox.engine.engine import Engine

    engine = Engine.for_home(home)
    for t in ("base", browser_template):
        assert resolve.image_id_for(engine, t) == resolve.image_for(engine, t).image_id
