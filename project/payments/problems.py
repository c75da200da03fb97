"""A request body the demo cannot read is the client's 400, as ``application/problem+json`` (RFC 9457).

ratelimits renders its own 429 and 503 (``ratelimits.drf.exception_handler``); this adds the
demo's 400 for a JSON body that is malformed or nested too deep. DRF's ``JSONParser`` turns only
a ``ValueError`` into a ``ParseError``: a body of 100,000 ``[`` makes ``json.load`` raise
``RecursionError`` instead, which DRF left to become a 500.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from django.http import HttpResponse
from drf_spectacular.utils import OpenApiResponse
from rest_framework import parsers
from rest_framework.exceptions import ParseError

from ratelimits.drf import exception_handler as ratelimits_exception_handler
from ratelimits.problems import CONTENT_TYPE

__all__ = ["MALFORMED_BODY", "JSONParser", "exception_handler"]

#: The 400 of :func:`exception_handler`, for the OpenAPI schema of a view that reads a body.
MALFORMED_BODY = OpenApiResponse(
    response={
        "type": "object",
        "required": ["type", "title", "status", "detail"],
        "properties": {
            "type": {"type": "string", "enum": ["about:blank"]},
            "title": {"type": "string", "enum": ["Bad Request"]},
            "status": {"type": "integer", "enum": [400]},
            "detail": {"type": "string", "description": "Why the body could not be parsed."},
        },
    },
    description="The body could not be parsed (malformed JSON, or JSON nested too deep): an "
    "`application/problem+json` body. A body that parsed but names a field wrongly is `application/json`, "
    "each key naming a field.",
)


class JSONParser(parsers.JSONParser):
    """DRF's JSON parser, except that a body nested deeper than Python's parser can follow is a ``ParseError``."""

    def parse(self, stream: Any, media_type: str | None = None, parser_context: Mapping[str, Any] | None = None) -> Any:
        try:
            return super().parse(stream, media_type, parser_context)
        except RecursionError:
            # Raised from deep in the parser's recursion, and caught once it has unwound: handled here
            # with the stack as deep as the view's, which is nowhere near the limit.
            raise ParseError("JSON parse error - nested too deeply for this server to read") from None


def exception_handler(exc: Exception, context: dict[str, Any]) -> HttpResponse | None:
    """ratelimits' handler (its 429 and 503 as problem+json, DRF's handling for the rest), and a
    body the parsers refused as a 400 problem: ``about:blank``, its ``detail`` the parser's reason."""
    response = ratelimits_exception_handler(exc, context)
    if isinstance(exc, ParseError) and response is not None:
        body = {"type": "about:blank", "title": "Bad Request", "status": 400, "detail": str(exc.detail)}
        return HttpResponse(json.dumps(body), status=400, content_type=CONTENT_TYPE)
    return response
