"""How long the Mixed Precision tab's server takes to answer for a 100,000-step run.

Times the plugin's ``/run`` route (read through a data provider that holds 100,000 steps
of scalars and the run's events, downsampled for the page) in this process, the way
``tests/tbplugin/test_tbplugin.py`` serves it; the tests check what is served, this script how
fast. The browser's drawing time of the same payload is shown in the tab's status line
("Drawn in N ms"; ``tests/tbplugin/test_tbplugin_browser.py`` loads it).

Usage: ``python bench/bench_tab.py [--repeat 7]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from test_tbplugin import URL, LongRunProvider, serve  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    client = serve(LongRunProvider())
    times, size = [], 0
    for _ in range(args.repeat):
        start = time.perf_counter()
        response = client.get(f"{URL}/run?run=long")
        times.append(time.perf_counter() - start)
        size = len(response.get_data())
    print(
        f"/run of a {LongRunProvider.STEPS}-step run: median {1e3 * statistics.median(times):.0f} "
        f"ms over {args.repeat} requests (min {1e3 * min(times):.0f} ms), {size} bytes"
    )


if __name__ == "__main__":
    main()
