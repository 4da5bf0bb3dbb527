"""Install Debian's headless Chromium for the report tests when it is missing and we may (root, apt available).

Best effort: the browser tests skip with a clear reason when no Chromium can be had.
"""

import os
import shutil
import subprocess
import sys


def main() -> int:
    if shutil.which("chromium") or shutil.which("chromium-browser"):
        return 0
    if os.environ.get("DSV4_NO_BROWSER_INSTALL") or not shutil.which("apt-get") or os.geteuid() != 0:
        print("setup_browser: no chromium and cannot install it; browser tests will skip", file=sys.stderr)
        return 0
    print("setup_browser: installing Debian chromium for the HTML report tests...", file=sys.stderr)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    quiet = {"stdout": subprocess.DEVNULL, "env": env}
    subprocess.run(["apt-get", "update", "-qq"], check=False, **quiet)
    subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", "chromium"], check=False, **quiet)
    return 0


if __name__ == "__main__":
    sys.exit(main())
