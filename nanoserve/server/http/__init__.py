"""HTTP/1.1 transport on httptools: the parser and its limits (parser.py), one connection's
keep-alive, body budget and timers (connection.py), the listening server (server.py), response
bodies and SSE (writer.py), and the request and response types the app sees (types.py)."""
