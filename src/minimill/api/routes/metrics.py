"""`/metrics` for operators' Prometheus (api/metrics.py says what it holds). Operator keys
only; anyone else gets what an unknown URL gets."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from minimill.api.deps import OperatorDep

router = APIRouter(tags=["operator"], include_in_schema=False)


@router.get("/metrics")
def metrics(request: Request, _operator: OperatorDep) -> Response:
    return Response(generate_latest(request.app.state.metrics),
                    media_type=CONTENT_TYPE_LATEST)
