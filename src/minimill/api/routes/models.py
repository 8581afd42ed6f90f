"""GET /v1/models: the model names this control plane serves."""

from __future__ import annotations

from fastapi import APIRouter

from minimill.api.deps import ConfigDep, TenantDep
from minimill.api.errors import error_responses
from minimill.api.schemas import ModelList, ModelObject
from minimill.control.errors import NotFoundError

router = APIRouter(prefix="/v1/models", tags=["models"], responses=error_responses(401))
# Models are configuration, not rows: a fixed creation time keeps responses stable.
_CREATED = 1_735_689_600


@router.get("", response_model=ModelList)
def list_models(_tenant: TenantDep, config: ConfigDep) -> ModelList:
    return ModelList(data=[ModelObject(id=m, created=_CREATED) for m in config.served_models])


@router.get("/{model}", response_model=ModelObject, responses=error_responses(404))
def retrieve_model(model: str, _tenant: TenantDep, config: ConfigDep) -> ModelObject:
    if model not in config.served_models:
        raise NotFoundError(f"The model '{model}' does not exist", param="model",
                            code="model_not_found")
    return ModelObject(id=model, created=_CREATED)
