"""Web form and live dashboard for experiments: configure once, paste the join commands, watch the loss fall.

python run_web.py --port 8000 --db experiments.sqlite --admin_token "$TOKEN"    # then open http://127.0.0.1:8000
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Sequence

logger = logging.getLogger("run_web")


def main(argv: Sequence[str] | None = None) -> int:
    from collab.entry import escape_log_messages
    from collab.errors import UserError
    from collab.extras import require_extra

    try:
        require_extra("web", "the web app")
    except UserError as e:
        print(f"run_web.py: error: {e}", file=sys.stderr)
        return 2
    from web.settings import parse_web_args

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # the app's messages one line each; uvicorn's own handlers come later and write request paths percent-encoded
    escape_log_messages()
    try:
        settings = parse_web_args(argv)
    except UserError as e:
        print(f"run_web.py: error: {e}", file=sys.stderr)
        return 2

    import uvicorn

    from web.app import create_app
    from web.forms import validated_config

    app = create_app(settings)
    # The first validation imports hivemind (seconds): do it now so the first Save is quick.
    threading.Thread(target=validated_config, args=({},), daemon=True, name="warm-up").start()
    local_host = "127.0.0.1" if settings.host in ("0.0.0.0", "::") else settings.host
    logger.info("Open http://%s:%d (peers reach it as %s)", local_host, settings.port, settings.base_url)
    if settings.host not in ("127.0.0.1", "localhost", "::1") and not settings.base_url.startswith("https://"):
        logger.warning("Listening beyond loopback over plain http: tokens cross the network in clear (docs/WEB.md)")
    uvicorn.run(app, host=settings.host, port=settings.port, log_level="info", proxy_headers=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
