"""Creates a blob container in an Azure Blob Storage endpoint (azurite for the tests), signed
with the account's Shared Key: `python3 azure-container.py ENDPOINT ACCOUNT KEY CONTAINER`, where
ENDPOINT is path-style (`http://127.0.0.1:43750/devstoreaccount1`). Exits 0 when the container
exists afterwards (created now or before). Standard library only."""

import base64
import hashlib
import hmac
import sys
import urllib.error
import urllib.parse
import urllib.request
from email.utils import formatdate

endpoint, account, key, container = sys.argv[1:5]
url = f"{endpoint.rstrip('/')}/{container}?restype=container"
path = urllib.parse.urlparse(url).path
date = formatdate(usegmt=True)
version = "2021-08-06"
# Verb, then 11 standard headers (all empty here), then x-ms-* headers, then the resource.
string_to_sign = "PUT\n" + "\n" * 11 + f"x-ms-date:{date}\nx-ms-version:{version}\n" + f"/{account}{path}\nrestype:container"
signature = base64.b64encode(hmac.new(base64.b64decode(key), string_to_sign.encode(), hashlib.sha256).digest()).decode()
request = urllib.request.Request(
    url,
    method="PUT",
    headers={"Content-Length": "0", "x-ms-date": date, "x-ms-version": version, "Authorization": f"SharedKey {account}:{signature}"},
)
try:
    urllib.request.urlopen(request, timeout=10)
except urllib.error.HTTPError as error:
    body = error.read().decode(errors="replace")
    if error.code == 409 and "ContainerAlreadyExists" in body:
        sys.exit(0)
    print(f"creating the container {container}: {error.code} {body}", file=sys.stderr)
    sys.exit(1)
