"""Serve the linker over HTTP: the Serve app of configs/serve/link.yaml on a local Ray, clients at its edge.

    RAY_AUTH_MODE=token RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 python -m dist_nce.cli.serve_link \\
        configs/serve/link.yaml run=runs/demo/<time>
    curl -s -X POST http://127.0.0.1:8000/link -H 'Content-Type: application/json' \\
        -d '{"docs": [{"text": "Paris is in France .", "mentions": [[12, 18]]}], "k": 5}'

``key=value`` arguments override the application's ``args`` (ServeConfig fields; dotted keys reach
nested ones, ``link.k=5``; values are read as YAML). This is ``serve run CONFIG`` with overrides: Serve's
own proxy as the config says (off in the shipped one: the edge, ``edge_port``, answers HTTP), the
app deployed, and the process waits until Ctrl-C (or SIGTERM), which shuts Serve down. On a running cluster,
``serve deploy CONFIG --address ...`` after editing ``args.run`` does the same without the wait.
"""
from __future__ import annotations

import argparse
import signal
import sys
import threading

import yaml


def overridden(args: dict, pairs: list[str]) -> dict:
    """``args`` with each ``key=value`` (dotted keys for nested fields, values as YAML) set."""
    out = {**args}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"{pair!r}: expected key=value")
        *parents, leaf = key.split(".")
        node = out
        for p in parents:
            node[p] = dict(node.get(p) or {})
            node = node[p]
        node[leaf] = yaml.safe_load(value)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", help="Serve config YAML (configs/serve/link.yaml)")
    ap.add_argument("overrides", nargs="*", help="key=value: ServeConfig fields of the application's args")
    ap.add_argument("--address", help="a running Ray cluster (default: start a loopback-only local one)")
    a = ap.parse_args(argv)

    from dist_nce.core.config import ConfigError, load_yaml
    from dist_nce.link.serve import build_app

    try:
        config = load_yaml(a.config)  # a key given twice is an error naming the line, not the last one silently
    except (ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        (app,) = config["applications"]
        args = overridden(app.get("args") or {}, a.overrides)
        application = build_app(args)  # a wrong path or key fails here, before anything starts
    except (ConfigError, FileNotFoundError) as e:
        print(f"error: {a.config}: {e}", file=sys.stderr)
        return 2
    from ray import serve

    from dist_nce.cluster.runtime import init_ray

    init_ray(a.address)
    serve.start(proxy_location=config.get("proxy_location", "Disabled"), http_options=config.get("http_options"))
    serve.run(application, name=app.get("name", "link"), route_prefix=app.get("route_prefix"))
    if args.get("edge_port"):
        print(f"serving at http://{args.get('edge_host', '127.0.0.1')}:{args['edge_port']}{args.get('route', '/')}",
              flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # set after Ray's start, which installs handlers of its own
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass
    print("shutting down Serve", flush=True)
    serve.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
