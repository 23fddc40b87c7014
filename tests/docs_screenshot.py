#!/usr/bin/env python3
"""Serve the built documentation site and check it in headless Chromium (used by .ci/docs).

Usage: python tests/docs_screenshot.py SITE_DIR [--out site-shots] [--chromium PATH]

A standalone script, not a pytest test. It serves SITE_DIR with the standard library's HTTP server
on a free local port (in a thread of this process), then for each checked page:

* fetches the HTML over HTTP and checks that it contains the expected texts (the page title, a
  known function name) and that it references no stylesheet or script outside the site;
* fetches the theme's stylesheet that the page links to;
* takes a screenshot with ``chromium --headless --screenshot`` into the output folder and checks the
  PNG: it exists, is larger than a few KB, has the requested size, is not blank (many distinct
  colours, no single colour covering almost everything) and shows the theme's coloured header
  band (so the CSS was applied: an unstyled page has a white top).

Exits non-zero on any failure, after trying every page. Prints the screenshot paths.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import urllib.request
import zlib
from collections import Counter
from typing import Dict, List, Optional, Tuple

WIDTH, HEIGHT = 1280, 2000
MIN_PNG_BYTES = 20_000          # a blank 1280×2000 PNG compresses to a few KB
MIN_COLOURS = 64                # text with anti-aliasing gives hundreds of colours
MAX_DOMINANT_SHARE = 0.985      # the background may dominate, but not cover the whole page

# (name, path in the site, texts the HTML must contain)
PAGES: List[Tuple[str, str, List[str]]] = [
    ("quickstart", "quickstart/", ["<title>Quickstart", "clip_noise", "PrivateAggregator", "get_epsilon"]),
    ("api-index", "api/", ["<title>API index", "clip_noise", "dpcore.accounting", "dpcore.torch"]),
]


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base class's name)
        pass


def serve(root: str) -> Tuple[http.server.ThreadingHTTPServer, str]:
    handler = functools.partial(_QuietHandler, directory=root)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)   # port 0: a free port
    threading.Thread(target=server.serve_forever, daemon=True).start()
    host, port = server.server_address[:2]
    return server, f"http://{host}:{port}/"


def fetch(url: str) -> Tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return resp.status, resp.read()


def find_chromium(explicit: Optional[str]) -> str:
    for name in ([explicit] if explicit else []) + ["chromium", "chromium-browser", "google-chrome", "chrome"]:
        path = shutil.which(name) if name else None
        if path:
            return path
    raise SystemExit("docs_screenshot: no chromium on PATH (install Debian's `chromium` package)")


# ----------------------------------------------------------------------------------- PNG decoding

def _png_pixels_stdlib(data: bytes) -> Tuple[int, int, List[bytes], int]:
    """(width, height, rows of raw pixel bytes, bytes per pixel) of an 8-bit PNG, stdlib only."""
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("not a PNG file")
    pos, idat, width = 8, [], 0
    height = bit_depth = colour_type = interlace = 0
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        ctype = data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + length]
        pos += 12 + length
        if ctype == b"IHDR":
            width, height, bit_depth, colour_type, _, _, interlace = struct.unpack(">IIBBBBB", body)
        elif ctype == b"IDAT":
            idat.append(body)
        elif ctype == b"IEND":
            break
    channels = {0: 1, 2: 3, 4: 2, 6: 4}.get(colour_type)
    if bit_depth != 8 or channels is None or interlace:
        raise ValueError(f"unsupported PNG (bit depth {bit_depth}, colour type {colour_type}, interlace {interlace})")
    raw = zlib.decompress(b"".join(idat))
    bpp, stride = channels, width * channels
    rows: List[bytes] = []
    prev = bytearray(stride)
    for y in range(height):
        start = y * (stride + 1)
        ftype, line = raw[start], bytearray(raw[start + 1:start + 1 + stride])
        if ftype == 1:
            for i in range(bpp, stride):
                line[i] = (line[i] + line[i - bpp]) & 0xFF
        elif ftype == 2:
            line = bytearray((a + b) & 0xFF for a, b in zip(line, prev))
        elif ftype == 3:
            for i in range(stride):
                left = line[i - bpp] if i >= bpp else 0
                line[i] = (line[i] + ((left + prev[i]) >> 1)) & 0xFF
        elif ftype == 4:
            for i in range(stride):
                a = line[i - bpp] if i >= bpp else 0
                b = prev[i]
                c = prev[i - bpp] if i >= bpp else 0
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
        elif ftype != 0:
            raise ValueError(f"bad PNG filter type {ftype} in row {y}")
        rows.append(bytes(line))
        prev = line
    return width, height, rows, bpp


def png_rgb_rows(path: str) -> Tuple[int, int, List[List[bytes]]]:
    """Width, height and rows of RGB pixels (3 bytes each) of a PNG: Pillow when installed, else
    the stdlib decoder."""
    try:
        from PIL import Image  # type: ignore[import-not-found]
    except ImportError:
        Image = None
    if Image is not None:
        with Image.open(path) as im:
            rgb = im.convert("RGB")
            w, h = rgb.size
            data = rgb.tobytes()
        stride = 3 * w
        return w, h, [[data[y * stride + i:y * stride + i + 3] for i in range(0, stride, 3)] for y in range(h)]
    with open(path, "rb") as f:
        w, h, rows, bpp = _png_pixels_stdlib(f.read())
    out = []
    for row in rows:
        if bpp >= 3:
            out.append([row[i:i + 3] for i in range(0, len(row), bpp)])
        else:
            out.append([bytes((row[i],) * 3) for i in range(0, len(row), bpp)])
    return w, h, out


def check_png(path: str) -> List[str]:
    errors: List[str] = []
    if not os.path.isfile(path):
        return [f"{path}: no screenshot written"]
    size = os.path.getsize(path)
    if size < MIN_PNG_BYTES:
        errors.append(f"{path}: only {size} bytes (< {MIN_PNG_BYTES}): a blank page?")
    try:
        w, h, rows = png_rgb_rows(path)
    except Exception as exc:  # a truncated or corrupt file
        return errors + [f"{path}: cannot decode the PNG: {exc}"]
    if (w, h) != (WIDTH, HEIGHT):
        errors.append(f"{path}: {w}×{h}, expected {WIDTH}×{HEIGHT}")
    counts: Counter = Counter()
    for row in rows:
        counts.update(row)
    total = sum(counts.values())
    colour, n = counts.most_common(1)[0]
    share = n / total
    if len(counts) < MIN_COLOURS:
        errors.append(f"{path}: only {len(counts)} distinct colours (< {MIN_COLOURS}): a blank page?")
    if share > MAX_DOMINANT_SHARE:
        errors.append(f"{path}: one colour {tuple(colour)} covers {share:.1%} of the page: a blank page?")
    # The Material header is a band of the primary colour across the top: an unstyled page is white.
    band = Counter(px for row in rows[5:40] for px in row[::4])
    top, top_n = band.most_common(1)[0]
    top_share = top_n / sum(band.values())
    coloured = max(top) - min(top) > 60 and top_share > 0.5
    if not coloured:
        errors.append(f"{path}: no coloured header band at the top (dominant {tuple(top)}, {top_share:.0%}): "
                      "the stylesheet did not apply?")
    print(f"  {path}: {size / 1024:.0f} KiB, {w}×{h}, {len(counts)} colours, background "
          f"{tuple(colour)} {share:.0%}, header band {tuple(top)} {top_share:.0%}")
    return errors


# ------------------------------------------------------------------------------------- page checks

_EXTERNAL = re.compile(r'<(?:link|script)\b[^>]*\b(?:href|src)="(?:https?:)?//', re.I)
_STYLESHEET = re.compile(r'<link\b[^>]*\brel="stylesheet"[^>]*\bhref="([^"]+)"', re.I)


def check_html(base: str, path: str, expected: List[str]) -> List[str]:
    url = base + path
    try:
        status, body = fetch(url)
    except Exception as exc:
        return [f"{url}: cannot fetch: {exc}"]
    html = body.decode("utf-8", "replace")
    errors = [f"{url}: HTTP {status}"] if status != 200 else []
    errors += [f"{url}: does not contain {text!r}" for text in expected if text not in html]
    for m in _EXTERNAL.finditer(html):
        errors.append(f"{url}: references an external asset: {m.group(0)[:120]}")
    sheets = _STYLESHEET.findall(html)
    if not any("assets/stylesheets/main." in href for href in sheets):
        errors.append(f"{url}: links no theme stylesheet (assets/stylesheets/main.*.css)")
    for href in sheets:
        sheet_url = urllib.request.urljoin(url, href)
        theme = "assets/stylesheets/main." in href
        try:
            s_status, s_body = fetch(sheet_url)
            if s_status != 200 or (theme and len(s_body) < 10_000):
                errors.append(f"{sheet_url}: HTTP {s_status}, {len(s_body)} bytes")
        except Exception as exc:
            errors.append(f"{sheet_url}: cannot fetch: {exc}")
    return errors


def screenshot(chromium: str, url: str, out: str) -> List[str]:
    if os.path.exists(out):
        os.remove(out)
    with tempfile.TemporaryDirectory(prefix="docs-chromium-") as profile:
        cmd = [
            chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
            "--no-first-run", "--no-default-browser-check", "--disable-extensions",
            f"--user-data-dir={profile}", f"--screenshot={out}", f"--window-size={WIDTH},{HEIGHT}",
            "--virtual-time-budget=5000", url,
        ]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
        except subprocess.TimeoutExpired:
            return [f"{url}: chromium timed out"]
    if proc.returncode != 0 or not os.path.isfile(out):
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        return [f"{url}: chromium exited {proc.returncode}: " + " | ".join(tail)]
    return []


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("site", help="the built site (mkdocs build -d SITE)")
    parser.add_argument("--out", default="site-shots", help="folder for the screenshots (default: site-shots)")
    parser.add_argument("--chromium", help="the browser binary (default: chromium or chromium-browser on PATH)")
    args = parser.parse_args(argv)

    if not os.path.isfile(os.path.join(args.site, "index.html")):
        print(f"docs_screenshot: {args.site}/index.html not found: build the site first", file=sys.stderr)
        return 1
    chromium = find_chromium(args.chromium)
    os.makedirs(args.out, exist_ok=True)
    server, base = serve(os.path.abspath(args.site))
    print(f"serving {args.site} at {base}; browser {chromium}")
    errors: List[str] = []
    shots: Dict[str, str] = {}
    try:
        for name, path, expected in PAGES:
            errors += check_html(base, path, expected)
            out = os.path.join(args.out, f"{name}.png")
            errs = screenshot(chromium, base + path, out)
            errors += errs or check_png(out)
            shots[name] = out
    finally:
        server.shutdown()
        server.server_close()
    for name, out in shots.items():
        print(f"screenshot {name}: {os.path.abspath(out)}")
    if errors:
        print(f"docs_screenshot: {len(errors)} failure(s):", file=sys.stderr)
        for e in errors:
            print(f"  {e}", file=sys.stderr)
        return 1
    print(f"docs_screenshot: {len(shots)} pages checked, all passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
