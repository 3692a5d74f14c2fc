"""`llmd batch ...`: submit a JSONL file, watch it, fetch its results, over the HTTP API
(the same routes the openai SDK uses; a server, not the database, is the authority)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import click

from llmd.api_client import Api

FINAL = ("completed", "failed", "expired", "cancelled")


@click.group()
@click.option("--url", envvar="LLMD_URL", default="http://127.0.0.1:8000", show_default=True,
              help="The llmd server (or $LLMD_URL).")
@click.option("--api-key", envvar="LLMD_API_KEY", default=None, help="A tenant's key (or $LLMD_API_KEY).")
@click.pass_context
def batch(ctx: click.Context, url: str, api_key: str | None) -> None:
    """Batch API jobs: cheaper, asynchronous, run on capacity interactive traffic leaves."""
    ctx.obj = Api(url, api_key)


def _prepare(path: Path, model: str) -> tuple[bytes, str]:
    """The file with `model` set on every line (a line naming another model is an error), and its endpoint."""
    out, endpoints = [], set()
    for n, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
            body = obj.setdefault("body", {})
            if body.setdefault("model", model) != model:
                raise click.ClickException(f"{path}:{n}: the line asks for model {body['model']!r}, not {model!r}")
        except (json.JSONDecodeError, AttributeError):
            raise click.ClickException(f"{path}:{n}: not a JSON object with a 'body' object") from None
        obj.setdefault("method", "POST")
        endpoints.add(obj.setdefault("url", "/v1/chat/completions"))
        out.append(json.dumps(obj, ensure_ascii=False))
    if not out:
        raise click.ClickException(f"{path}: no requests in the file")
    if len(endpoints) > 1:
        raise click.ClickException(f"{path}: the lines use several endpoints {sorted(endpoints)}; a batch has one")
    return ("\n".join(out) + "\n").encode("utf-8"), endpoints.pop()


@batch.command()
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--model", required=True, help="The model every request uses.")
@click.option("--window", default="24h", show_default=True, help="Completion window.")
@click.option("--wait", is_flag=True, help="Show progress until the batch ends.")
@click.pass_obj
def submit(api: Api, file: Path, model: str, window: str, wait: bool) -> None:
    """Upload FILE (JSONL of custom_id/method/url/body) and start a batch on it."""
    data, endpoint = _prepare(file, model)
    f = api.call("POST", "/files", files={"file": (file.name, data)}, data={"purpose": "batch"}).json()
    b = api.call("POST", "/batches", json={"input_file_id": f["id"], "endpoint": endpoint,
                                           "completion_window": window}).json()
    if wait:
        b = _watch(api, b)
    c = b.get("request_counts") or {}
    click.echo(f"{b['id']} {b['status']} {c.get('completed', 0)}/{c.get('total', 0)}")
    if wait and b["status"] != "completed":
        sys.exit(1)


def _watch(api: Api, b: dict[str, Any]) -> dict[str, Any]:
    while b["status"] == "validating":
        time.sleep(0.5)
        b = api.call("GET", f"/batches/{b['id']}").json()
    total = (b.get("request_counts") or {}).get("total") or 0
    with click.progressbar(length=total, label=b["id"], file=sys.stderr, show_pos=True) as bar:
        shown = 0
        while b["status"] not in FINAL:
            time.sleep(1.0)
            b = api.call("GET", f"/batches/{b['id']}").json()
            c = b["request_counts"]
            bar.update(c["completed"] + c["failed"] - shown)
            shown = c["completed"] + c["failed"]
    for e in ((b.get("errors") or {}).get("data") or [])[:20]:
        click.echo(f"line {e.get('line')}: {e.get('code')}: {e.get('message')}", err=True)
    return b


@batch.command()
@click.argument("batch_id")
@click.pass_obj
def status(api: Api, batch_id: str) -> None:
    """Print the batch object (JSON)."""
    click.echo(json.dumps(api.call("GET", f"/batches/{batch_id}").json(), indent=2))


@batch.command()
@click.argument("batch_id")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="Where to write the output lines.")
@click.option("--errors", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Where to write the error lines, if any.")
@click.pass_obj
def results(api: Api, batch_id: str, output: Path, errors: Path | None) -> None:
    """Download a finished batch's output (and error) file."""
    b = api.call("GET", f"/batches/{batch_id}").json()
    if b["status"] not in FINAL:
        raise click.ClickException(f"{batch_id} is {b['status']}; its results exist once it ends")
    n = 0
    for fid, dest in ((b.get("output_file_id"), output), (b.get("error_file_id"), errors)):
        if dest is None:
            continue
        data = api.call("GET", f"/files/{fid}/content").content if fid else b""
        dest.write_bytes(data)
        n += data.count(b"\n")
    click.echo(f"{batch_id} {b['status']}: {n} lines written")
