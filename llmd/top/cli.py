"""`llmd top`: poll a node every `--interval` seconds and redraw (Ctrl-C ends it); `--once`
polls twice, `--interval` apart, prints one frame and exits."""

from __future__ import annotations

import sys
import time

import click
import httpx

from llmd.api_client import Api


@click.command()
@click.option("--url", envvar="LLMD_URL", default="http://127.0.0.1:8000", show_default=True,
              help="The llmd node (or $LLMD_URL).")
@click.option("--key", "--api-key", "key", envvar="LLMD_ADMIN_KEY", default=None,
              help="An admin key (or $LLMD_ADMIN_KEY); without one, what the node shows without a key.")
@click.option("--interval", default=2.0, show_default=True, type=click.FloatRange(0.1, 3600),
              help="Seconds between polls.")
@click.option("--once", is_flag=True, help="Print one frame (over one interval) and exit.")
def top(url: str, key: str | None, interval: float, once: bool) -> None:
    """A live view of a node: per model requests and tokens per second, TTFT and ITL p50/p95, queues,
    seats, KV and prefix-cache use, preemptions, sheds and serving cost per million tokens; per
    tenant requests per second, TTFT p95 and spend today; the cluster's members."""
    from rich.console import Console  # here: every other command starts without rich
    from rich.live import Live

    from llmd.top.fetch import Poller
    from llmd.top.frame import compute
    from llmd.top.render import render

    api = Api(url, key, prefix="")
    api.http.timeout = httpx.Timeout(10.0)
    poller = Poller(api)
    prev = poller.poll()
    if once:
        time.sleep(interval)
        width = None if sys.stdout.isatty() else 100
        Console(width=width).print(render(compute(poller.poll(), prev)))
        return
    with Live(render(compute(prev, None)), auto_refresh=False) as live:
        try:
            while True:
                time.sleep(interval)
                cur = poller.poll()
                live.update(render(compute(cur, prev)), refresh=True)
                prev = cur
        except KeyboardInterrupt:
            pass
