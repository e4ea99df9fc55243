#!/usr/bin/env python3
"""Counting HTTP proxy for benchmarks (not a test): forwards every request to LocalStack and counts
them by AWS operation (SQS by its X-Amz-Target or Action, S3 by method), so a benchmark counts what
every fleet process asks of AWS, all told, without trusting the processes' own counters.

    counting-proxy.py LISTEN_PORT UPSTREAM_PORT      e.g. 4567 4566
    curl 127.0.0.1:4567/__counts                     -> {"sqs.ReceiveMessage": 3, ...}
"""
import http.client
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs

COUNTS = {}
LOCK = threading.Lock()
DEBUG = False
HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "upgrade"}


def operation(headers, path, method, body):
    target = headers.get("X-Amz-Target")
    if target:
        return "sqs." + target.split(".")[-1]
    if headers.get("Content-Type", "").startswith("application/x-www-form-urlencoded"):
        action = parse_qs(body.decode("utf-8", "replace")).get("Action")
        if action:
            return "sqs." + action[0]
    if path.startswith("/_localstack"):
        return None
    return "s3." + method


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def body(self):
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    self.rfile.readline()
                    return out
                out += self.rfile.read(size)
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def handle_any(self):
        body = self.body()
        if self.path == "/__counts":
            with LOCK:
                data = json.dumps(COUNTS, sort_keys=True).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        op = operation(self.headers, self.path, self.command, body)
        if DEBUG:
            sys.stderr.write(f"{self.command} {self.path} {dict(self.headers)} {body[:200]!r}\n")
        if op:
            with LOCK:
                COUNTS[op] = COUNTS.get(op, 0) + 1
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP and k.lower() != "content-length"}
        headers["Content-Length"] = str(len(body))
        try:
            conn = http.client.HTTPConnection("127.0.0.1", UPSTREAM, timeout=120)
            conn.request(self.command, self.path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
        except OSError as e:
            data = str(e).encode()
            self.send_response(502)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        self.send_response(resp.status)
        for k, v in resp.getheaders():
            if k.lower() not in HOP and k.lower() != "content-length":
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
        conn.close()

    do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = handle_any


if __name__ == "__main__":
    listen, UPSTREAM = int(sys.argv[1]), int(sys.argv[2])
    ThreadingHTTPServer.daemon_threads = True
    ThreadingHTTPServer(("127.0.0.1", listen), Handler).serve_forever()
