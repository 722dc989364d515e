#!/usr/bin/env python3
"""The image's HEALTHCHECK: exit 0 when GET URL answers 200, else 1 (Docker reserves 2).

    nanoserve-healthcheck [URL]      URL defaults to http://127.0.0.1:8000/health

/health needs no API key. Proxy variables are ignored: the server is on this container's loopback.
"""

import sys
import urllib.request

DEFAULT_URL = "http://127.0.0.1:8000/health"


def main(argv: list[str]) -> int:
    url = argv[0] if argv else DEFAULT_URL
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=5) as response:
            return 0 if response.status == 200 else 1
    except Exception as error:  # refused, timed out, 503 from a dead engine: all mean unhealthy
        print(f"unhealthy: {url}: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
