"""What a front in the request path would cost: Triton's HTTP endpoint answers a body it cannot parse as JSON with
500 ("failed to parse the request JSON buffer") before any model sees it. A front that parses each body first could
answer 400 instead; this measures that front's cost, so the choice is made from numbers (docs/triton.md).

    .venv/bin/python benchmarks/http_front.py [--repository model_repository/<name>] [--rounds 3] [--requests 400]

Serves the repository (default: the first one the triton step published under model_repository/), starts the front
(an aiohttp server in a process of its own: every POST body parsed with json.loads, a bad one answered 400 with the
parser's message, the rest forwarded unchanged to tritonserver's HTTP port over a kept-alive connection pool), then
times one-text requests (HTTP JSON, closed loop) straight to tritonserver and through the front, interleaved, at
concurrency 1 and 64. Prints what each answers to a non-JSON body, and per level the medians over the rounds:
requests/s and p50/p99 ms of each path with the front's ratio. Exits 0.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
from peerlib.peers import http_level, triton_embedder

from workbench.core.data import load_corpus
from workbench.core.errors import ConfigError
from workbench.core.interrupt import script_exit
from workbench.core.machine import cpu_features, others_busy
from workbench.measure.tables import ServedLevel
from workbench.serving.endpoints import text_endpoints
from workbench.serving.server import TritonServer, free_port

ROOT = Path(__file__).resolve().parents[1]
LEVELS = (1, 64)


def front(port: int, upstream: str) -> None:
    """The front: parse, answer 400 on a bad body, else forward (runs until killed)."""
    import aiohttp
    from aiohttp import web

    async def start(app: web.Application) -> None:
        app["session"] = aiohttp.ClientSession(f"http://{upstream}", connector=aiohttp.TCPConnector(limit=256))

    async def stop(app: web.Application) -> None:
        await app["session"].close()

    async def forward(request: web.Request) -> web.Response:
        body = await request.read()
        if request.method == "POST" and body:
            try:
                json.loads(body)
            except ValueError as exc:
                return web.json_response({"error": f"the request body is not JSON: {exc}"}, status=400)
        async with request.app["session"].request(request.method, request.rel_url, data=body,
                                                  headers={"Content-Type": "application/json"}) as answer:
            return web.Response(body=await answer.read(), status=answer.status, content_type="application/json")

    app = web.Application(client_max_size=64 * 2**20)
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    app.router.add_route("*", "/{tail:.*}", forward)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def start_front(upstream: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    process = subprocess.Popen([sys.executable, __file__, "--front", str(port), upstream])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return process, f"127.0.0.1:{port}"
        except OSError:
            time.sleep(0.2)
    process.kill()
    raise ConfigError("the front did not start listening within 60 s", "check that aiohttp imports")


def bad_body_status(url: str) -> str:
    request = urllib.request.Request(url, b"not json", {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return f"{answer.status} {answer.read()[:120]!r}"
    except urllib.error.HTTPError as error:
        return f"{error.code} {error.read()[:120]!r}"


def default_repository() -> Path:
    found = sorted(p for p in (ROOT / "model_repository").glob("*") if (p / ".workbench.json").is_file())
    if not found:
        raise ConfigError("no repository under model_repository/", "run `make demo` first, or pass --repository")
    return found[0]


def compare() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repository", type=Path, help="a Triton model repository the triton step wrote")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=400, help="requests per level and path, each round")
    parser.add_argument("--front", nargs=2, metavar=("PORT", "UPSTREAM"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.front:
        front(int(args.front[0]), args.front[1])
        return
    repository = args.repository or default_repository()
    endpoint = text_endpoints(repository)[0]
    texts = list(load_corpus())
    print(f"host: {cpu_features().recorded()}; other processes kept {others_busy():.1f} cores busy before")
    with tempfile.TemporaryDirectory() as workdir, TritonServer(repository, Path(workdir)) as server:
        process, front_url = start_front(server.http_url)
        try:
            direct = triton_embedder("direct", "fp32", server, endpoint.model, endpoint.output)
            fronted = dataclasses.replace(direct, name="front", url=direct.url.replace(server.http_url, front_url))
            print(f"a non-JSON body: tritonserver answers {bad_body_status(direct.url)}")
            print(f"                 the front answers {bad_body_status(fronted.url)}")
            results: dict[tuple[str, int], list[ServedLevel]] = {}
            for _ in range(args.rounds):
                for concurrency in LEVELS:
                    for path in (direct, fronted):
                        results.setdefault((path.name, concurrency), []).append(
                            http_level(path, texts, concurrency, args.requests, 120))
        finally:
            process.kill()
            process.wait()
    print("| concurrency | path | req/s | p50 ms | p99 ms |\n|---|---|---|---|---|")
    for concurrency in LEVELS:
        for name in ("direct", "front"):
            runs = results[(name, concurrency)]
            rps, p50, p99 = (float(np.median([getattr(r, key) for r in runs])) for key in ("throughput", "p50", "p99"))
            print(f"| {concurrency} | {name} | {rps:.1f} | {p50:.2f} | {p99:.2f} |")
        base = {key: float(np.median([getattr(r, key) for r in results[("direct", concurrency)]]))
                for key in ("throughput", "p50")}
        mine = {key: float(np.median([getattr(r, key) for r in results[("front", concurrency)]]))
                for key in ("throughput", "p50")}
        print(f"c{concurrency}: the front keeps {mine['throughput'] / base['throughput']:.2f}x the requests/s, "
              f"p50 {mine['p50'] / base['p50']:.2f}x")


if __name__ == "__main__":
    sys.exit(script_exit(compare, "nothing kept"))
