#!/usr/bin/env python3
"""A small webhook receiver for the demo: checks each request's Standard Webhooks signature with
the endpoint secret and appends what arrived to a log file. Usage: PORT SECRET LOGFILE"""
import base64, hashlib, hmac, sys, time
from http.server import BaseHTTPRequestHandler, HTTPServer

port, secret, log = int(sys.argv[1]), sys.argv[2], sys.argv[3]
key = base64.b64decode(secret.removeprefix("whsec_"))


class Hook(BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        wid, ts = self.headers["webhook-id"], self.headers["webhook-timestamp"]
        mac = hmac.new(key, f"{wid}.{ts}.".encode() + body, hashlib.sha256).digest()
        expected = "v1," + base64.b64encode(mac).decode()
        given = self.headers["webhook-signature"].split(" ")
        fresh = abs(time.time() - int(ts)) < 300
        ok = fresh and any(hmac.compare_digest(expected, s) for s in given)
        with open(log, "a") as out:
            out.write(f"webhook-id: {wid}\nsignature {'verified' if ok else 'INVALID'}\n{body.decode()}\n")
        self.send_response(204 if ok else 400)
        self.end_headers()

    def log_message(self, *args):
        pass


HTTPServer(("127.0.0.1", port), Hook).serve_forever()
