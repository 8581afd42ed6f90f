"""Signing webhook deliveries as Standard Webhooks does (standardwebhooks.com), which is also
what OpenAI's clients verify (`client.webhooks.unwrap`). Pure functions.

A delivery carries `webhook-id` (the event id: the same on every retry, so receivers can drop
duplicates), `webhook-timestamp` (Unix seconds of this attempt) and `webhook-signature`:
`v1,` + base64 HMAC-SHA256 of `{id}.{timestamp}.{body}` under the endpoint's secret, which is
`whsec_` + the base64 of 32 random bytes.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets

SECRET_PREFIX = "whsec_"


def new_secret() -> str:
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(32)).decode()


def secret_hint(secret: str) -> str:
    """What may be shown of a secret after its creation."""
    return SECRET_PREFIX + "..." + secret[-4:]


def signature(secret: str, message_id: str, timestamp: int, body: str) -> str:
    key = base64.b64decode(secret.removeprefix(SECRET_PREFIX))
    digest = hmac.new(key, f"{message_id}.{timestamp}.{body}".encode(), hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def signed_headers(secret: str, message_id: str, timestamp: int, body: str) -> dict[str, str]:
    return {"webhook-id": message_id, "webhook-timestamp": str(timestamp),
            "webhook-signature": signature(secret, message_id, timestamp, body),
            "content-type": "application/json"}
