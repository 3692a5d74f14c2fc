"""Config reload without a restart: `llmd reload` (SIGHUP to the pid beside the database)
swaps tenants, keys, quotas, filters and prices at once; a file that does not validate is
refused with the named error and the config in force stays."""

from __future__ import annotations

import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest

from bench.lib.servers import spawn, stop, wait_ready
from llmd.auth import Authenticator, generate_key, hash_key
from llmd.config import Config, ConfigError
from llmd.node import build_node
from llmd.policy.admission import AdmissionController
from llmd.reload import merge
from tests.conftest import REPO, fake_toml, free_port

BASE = """
[server]
host = "127.0.0.1"
port = {port}
db_path = "{db}"
[[models]]
name = "fake"
backend = "fake"
[models.fake]
step_ms = 1
[models.pricing]
output_per_mtok = {price}
[[filters]]
name = "words"
type = "blocklist"
words = ["{word}"]
"""


def tenant(name: str, keys: list[str], extra: str = "") -> str:
    hashes = ", ".join(f'"{hash_key(k)}"' for k in keys)
    return f'\n[[tenants]]\nname = "{name}"\nkeys = [{hashes}]\n{extra}'


def llmd_reload(cfg: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "llmd", "reload", "--config", str(cfg)], check=False,
                          capture_output=True, text=True, timeout=60, cwd=REPO)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[Path, str, Callable[[str], None]]]:
    port = free_port()
    cfg = tmp_path / "config.toml"
    log = tmp_path / "server.log"
    holder: list[subprocess.Popen[bytes]] = []

    def start(text: str) -> None:
        cfg.write_text(text)
        holder.append(spawn([sys.executable, "-m", "llmd", "serve", "--config", str(cfg)], log))
        wait_ready(holder[0], f"http://127.0.0.1:{port}/ready", 60, log)
        end = time.monotonic() + 30
        while not (tmp_path / "llmd.pid").exists() and time.monotonic() < end:
            time.sleep(0.05)

    yield cfg, f"http://127.0.0.1:{port}", start
    for p in holder:
        stop(p)


def works(url: str, key: str) -> bool:
    try:
        openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0).completions.create(
            model="fake", prompt="hi", max_tokens=2)
    except openai.AuthenticationError:
        return False
    return True


def post(url: str, key: str, prompt: str = "hi", max_tokens: int = 2) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": "fake", "prompt": prompt, "max_tokens": max_tokens},
                      headers={"Authorization": f"Bearer {key}"}, timeout=30)


def test_reload_swaps_tenants_keys_quotas_filters_and_prices(server) -> None:
    cfg, url, start = server
    port = int(url.rsplit(":", 1)[1])
    ka, ka2, kb = generate_key(), generate_key(), generate_key()
    a_filters = 'input_filters = ["words"]\n'

    def config(price: float, word: str) -> str:
        return BASE.format(port=port, db=cfg.parent / "llmd.db", price=price, word=word)

    start(config(0.0, "alpha") + tenant("a", [ka, ka2], a_filters + "tokens_per_minute = 10000\n"))
    assert works(url, ka) and works(url, ka2) and not works(url, kb)
    r = post(url, ka2, "a forbidden word")
    assert r.status_code == 200 and r.headers["x-ratelimit-limit-tokens"] == "10000"
    # v2: key ka removed, tenant b new, a's quota raised, the blocklist's words changed, a price set.
    v2 = config(1e6, "forbidden") + tenant("a", [ka2], a_filters + "tokens_per_minute = 30000\n") \
        + tenant("b", [kb], "tokens_per_minute = 20000\n")
    cfg.write_text(v2)
    done = llmd_reload(cfg)
    assert done.returncode == 0 and "reloaded" in done.stdout, done.stdout + done.stderr
    assert not works(url, ka) and works(url, ka2) and works(url, kb)
    assert post(url, ka2).headers["x-ratelimit-limit-tokens"] == "30000"
    assert post(url, kb, max_tokens=3).headers["x-ratelimit-limit-tokens"] == "20000"
    r = post(url, ka2, "a forbidden word")
    assert r.status_code == 400 and r.json()["error"]["code"] == "content_filter"
    rows = httpx.get(url + "/v1/usage?rows=1", headers={"Authorization": f"Bearer {kb}"}, timeout=30).json()["data"]
    assert sorted(round(x["cost"], 6) for x in rows) == [2.0, 3.0]  # 1 per output token: the new price
    # v3 does not validate: refused whole, named, and v2 stays in force.
    cfg.write_text(config(0.0, "alpha") + tenant("a", [ka], "weight = -1\n") + tenant("b", [kb]))
    refused = llmd_reload(cfg)
    assert refused.returncode != 0 and "tenants[0].weight" in refused.stderr, refused.stderr
    assert str(cfg) in refused.stderr and "unchanged" in refused.stderr and "Traceback" not in refused.stderr
    assert works(url, ka2) and works(url, kb) and not works(url, ka)
    assert post(url, ka2, "a forbidden word").status_code == 400
    log = (cfg.parent / "server.log").read_text()
    assert "config_reloaded" in log and "config_reload_refused" in log and "tenants[0].weight" in log


def test_reload_without_a_server_says_so(tmp_path: Path) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text(BASE.format(port=1, db=tmp_path / "llmd.db", price=0, word="x"))
    r = llmd_reload(cfg)
    assert r.returncode != 0 and "llmd.pid" in r.stderr and "Traceback" not in r.stderr


# -- what a reload changes, piece by piece -------------------------------------------------------
MODELS = [{"name": "m", "backend": "fake", "pricing": {"output_per_mtok": 1.0}}]


def test_merge_keeps_models_server_and_batch_and_names_what_it_leaves() -> None:
    old = Config.model_validate({"models": MODELS})
    new = Config.model_validate({
        "server": {"max_body_bytes": 10}, "batch": {"max_requests": 5},
        "models": [{"name": "m", "backend": "fake", "max_output_tokens": 64, "default_max_tokens": 8,
                    "pricing": {"output_per_mtok": 9.0}}, {"name": "n", "backend": "fake"}],
        "tenants": [{"name": "t", "keys": [hash_key("k")]}]})
    merged, notes = merge(old, new)
    (m,) = merged.models
    assert m.pricing.output_per_mtok == 9.0 and m.max_output_tokens == old.models[0].max_output_tokens
    assert merged.server == old.server and merged.batch == old.batch and merged.tenants == new.tenants
    text = " ".join(notes)
    assert "'m': only pricing and filters" in text and "'n' is new" in text
    assert "[server]" in text and "[batch]" in text
    assert merge(old, old)[1] == []


def test_reload_on_a_network_address_refuses_open_mode() -> None:
    key = generate_key()
    metrics = {"metrics_keys": [hash_key(generate_key())]}
    cfg = Config.model_validate({"server": {"host": "0.0.0.0", "allow_plaintext": True}, "models": MODELS,
                                 "auth": metrics, "tenants": [{"name": "t", "keys": [hash_key(key)]}]})
    node = build_node(cfg)
    with pytest.raises(ConfigError, match="open mode"):
        node.reload(Config.model_validate({"models": MODELS, "auth": metrics}))
    with pytest.raises(ConfigError, match=r"auth\.metrics_keys: .* /metrics"):  # the metrics key dropped
        node.reload(Config.model_validate({"models": MODELS, "tenants": [{"name": "t", "keys": [hash_key(key)]}]}))
    assert node.auth.authenticate(f"Bearer {key}").tenant is not None  # the old keys stay
    node.reload(Config.model_validate({"models": MODELS, "auth": metrics,
                                       "tenants": [{"name": "u", "keys": [hash_key("x" * 40)]}]}))
    assert isinstance(node.auth, Authenticator) and node.auth.authenticate("Bearer " + "x" * 40).tenant.name == "u"


def test_admission_takes_new_limits_and_keeps_what_was_used() -> None:
    now = [0.0]
    tenants = Config.model_validate({"models": MODELS, "tenants": [
        {"name": "t", "tokens_per_minute": 100, "max_concurrent": 1}]}).tenants
    ac = AdmissionController(tenants, lambda: now[0])
    ticket = ac.admit(tenants[0], 60, queue_depth=0, max_queue=10, est_wait_s=0, time_left_s=10)
    assert not hasattr(ticket, "reason")
    raised = Config.model_validate({"models": MODELS, "tenants": [
        {"name": "t", "tokens_per_minute": 1000, "max_concurrent": 2, "requests_per_minute": 1}]}).tenants
    ac.reconfigure(raised)
    lim = ac.limits(raised[0])
    assert lim.tokens_limit == 1000 and lim.tokens_remaining == 40  # the 60 used still count
    assert lim.requests_limit == 2 and lim.requests_remaining == 1  # the request in flight still counts
    ok = ac.admit(raised[0], 10, queue_depth=0, max_queue=10, est_wait_s=0, time_left_s=10)
    assert not hasattr(ok, "reason")
    again = ac.admit(raised[0], 10, queue_depth=0, max_queue=10, est_wait_s=0, time_left_s=10)
    assert getattr(again, "reason", None) == "concurrency"
    lowered = Config.model_validate({"models": MODELS, "tenants": [{"name": "t", "tokens_per_minute": 20}]}).tenants
    ac.reconfigure(lowered)
    assert ac.limits(lowered[0]).tokens_remaining == 20  # capped at the new capacity


async def test_reload_reaches_the_fair_queues(make_server) -> None:
    key = generate_key()
    live = await make_server(fake_toml() + tenant("a", [key], "weight = 1.0\n"))
    before = live.runtime()
    notes = live.node.reload(Config.model_validate(tomllib.loads(fake_toml() + tenant("a", [key], "weight = 4.0\n")
                                                                  + tenant("b", [generate_key()], "weight = 2.0\n"))))
    # The test server's port and db_path are not in this file: a note says [server] waits for a restart.
    assert notes == ["[server] changes apply at the next start"] and live.runtime() is before
    assert [c.fairness.weights for c in before.queue.classes.values()] == [{"a": 4.0, "b": 2.0}] * 2


async def test_reload_moves_when_a_waiting_request_counts_as_late(make_server) -> None:
    """Late last reads the model's first-token objective: a reloaded [slo] applies to the queue too."""
    live = await make_server(fake_toml() + "[slo]\nttft_p95_s = 1.0\n")
    core = live.runtime().scheduler.core
    assert core.late_after_s == 1.0
    live.node.reload(Config.model_validate(tomllib.loads(fake_toml() + "[slo]\nttft_p95_s = 2.5\n")))
    assert core.late_after_s == 2.5
    fixed = fake_toml().replace("[models.scheduling]\n", "[models.scheduling]\nlate_after_s = 0.5\n")
    live2 = await make_server(fixed)
    live2.node.reload(Config.model_validate(tomllib.loads(fixed + "[slo]\nttft_p95_s = 2.5\n")))
    assert live2.runtime().scheduler.core.late_after_s == 0.5  # the model's own setting wins
