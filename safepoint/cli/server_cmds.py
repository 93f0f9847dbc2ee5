"""Command group `safepoint server start|stop|status`: the shared local Prefect server (flows/local_server.py).

Commands that run flows start it on first use when PREFECT_API_URL is unset; these commands let a
user start it ahead of time (e.g. before `watch --emit` and `serve`), check it, and stop it. One started
here is pinned: it is not stopped for idleness (`[server] idle_stop_s`) until `server stop`.
`server stop` signals only the keeper its state file names beyond doubt, and says "stopped" only
once the server is gone (else exit 2).
"""

from __future__ import annotations

import time

from safepoint.flows import local_server as ls

EXIT_OK, EXIT_NONE = 0, 1


def cmd_server(args) -> int:
    from safepoint.cli.main import err, out

    configured = ls.configured_api_url()
    home = ls.prefect_home()
    if args.action == "stop":
        state = ls.stop(home)
        out.print(f"stopped the local Prefect server (pid {state.pid}, {state.ui_url})" if state
                  else f"no local Prefect server for {home}")
        return EXIT_OK
    if configured:
        out.print(f"PREFECT_API_URL is set: Safepoint uses {configured} and starts no local server")
        return EXIT_OK
    if args.action == "start":
        state = ls.ensure_server(home, ls.startup_timeout_s(), on_start=lambda text: err.print(text), pin=True)
    else:
        state = ls.read_state(home)
        if state is None or not ls.running(state) or not ls.healthy(state.api_url):
            out.print(f"no local Prefect server running for {home}")
            return EXIT_NONE
    up = time.time() - state.started_at
    out.print(f"local Prefect server: {state.ui_url} (API {state.api_url}), pid {state.pid}, up {up:.0f} s, "
              f"PREFECT_HOME {state.home}")
    return EXIT_OK


def register(sub) -> None:
    s = sub.add_parser("server")
    s.add_argument("action", choices=["start", "stop", "status"],
                   help="start it now, stop it, or print its address and pid")
    s.set_defaults(fn=cmd_server)
