"""The embedded server's UI in a real browser: the default path a new user meets, then screenshots.

Fresh SAFEPOINT_HOME and PREFECT_HOME, no PREFECT_API_URL: `safepoint demo` starts the embedded
server and ingests three steps (the third corrupt). Headless Chromium then opens the server's runs
page and the corrupt run's page, saves both screenshots, and fails (exit 1) if a page says
"Can't connect" or the runs are not shown. The server is stopped at the end.

Chromium comes from Debian's packages in the apt cache (`playwright install` needs the internet):
they and the few libraries it needs are unpacked into a temporary folder (/work/shared/browser-notes.md).
Needs `pip install playwright` (the Python package only).

    python bench/ui_screenshot.py --out docs/img
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

APT = Path("/var/cache/apt/archives")
#: chromium, and the shared libraries of its Debian package that a slim image lacks
DEBS = ["chromium-common", "chromium", "libopenh264-7", "libdouble-conversion3", "libharfbuzz-subset0", "libpulse0",
        "libflac12", "libopus0", "libxnvctrl0", "libminizip1", "libopenjp2-7", "libogg0", "libsndfile1",
        "libasyncns0", "libvorbis0a", "libvorbisenc2", "libmpg123-0", "libmp3lame0"]


def unpack_chromium(into: Path) -> tuple[str, dict[str, str]]:
    """The chromium binary and the environment it runs in, from the apt cache."""
    for name in DEBS:
        debs = sorted(glob.glob(str(APT / f"{name}_*_amd64.deb")))
        if debs:
            subprocess.run(["dpkg-deb", "-x", debs[-1], str(into)], check=True)
        elif name.startswith("chromium"):
            sys.exit(f"{name} is not in {APT}; try `apt-get download {name}`")
    libs = into / "usr/lib/x86_64-linux-gnu"
    env = dict(os.environ, LD_LIBRARY_PATH=f"{libs}:{libs / 'pulseaudio'}")
    return str(into / "usr/lib/chromium/chromium"), env


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "img"), help="folder for the screenshots")
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    from safepoint.flows import local_server

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="sp-ui-") as tmp:
        base = Path(tmp)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "SAFEPOINT_"))}
        env.update(PREFECT_HOME=str(base / "prefect-home"), SAFEPOINT_HOME=str(base / "sp-home"),
                   PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
        home = Path(env["PREFECT_HOME"])
        try:
            demo = subprocess.run([sys.executable, "-m", "safepoint.cli", "demo", "--dir", str(base / "demo")],
                                  env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
            print(demo.stdout, demo.stderr, sep="\n")
            if demo.returncode != 0:
                return 2
            state = local_server.read_state(home)
            chromium, chrome_env = unpack_chromium(base / "chromium")
            problems = []
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=chromium, env=chrome_env,
                                            args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
                page = browser.new_page(viewport={"width": 1440, "height": 1000})
                page.goto(f"{state.ui_url}/runs", wait_until="networkidle")
                page.get_by_text("ingest-demo-run-30").first.wait_for(timeout=60_000)
                page.wait_for_load_state("networkidle")
                runs_png = out / "embedded-ui-runs.png"
                page.screenshot(path=str(runs_png), full_page=True)
                text = page.inner_text("body")
                if "Can't connect" in text or "Can’t connect" in text:
                    problems.append("runs page: Can't connect")
                missing = [f"ingest-demo-run-{s}" for s in (10, 20, 30) if f"ingest-demo-run-{s}" not in text]
                if missing:
                    problems.append(f"runs page lacks {missing}")
                page.get_by_text("ingest-demo-run-30").first.click()
                page.wait_for_url(re.compile(r".*/runs/flow-run/.*"), timeout=60_000)
                line = page.get_by_text("ended corrupt").first  # Safepoint's own log line, in the run's logs
                line.wait_for(timeout=60_000)
                line.scroll_into_view_if_needed()
                run_png = out / "embedded-ui-run-corrupt.png"
                page.screenshot(path=str(run_png))
                text = page.inner_text("body")
                if "Failed" not in text or "didn't generate logs" in text:
                    problems.append("corrupt run page: not Failed, or no logs")
                browser.close()
            print(f"screenshots: {runs_png} {run_png}")
            for line in problems:
                print(f"PROBLEM: {line}")
            return 1 if problems else 0
        finally:
            local_server.stop(home)


if __name__ == "__main__":
    sys.exit(main())
