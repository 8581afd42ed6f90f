"""Operator routes of the price list: what tenants are billed per model and tier."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query

from minimill.api.deps import ConfigDep, OperatorDep, StoreDep
from minimill.api.errors import error_responses
from minimill.api.operator_schemas import PriceDeleted, PriceObject, PriceSet, PriceTable
from minimill.control import prices

# Not in the public OpenAPI document: tenants should not learn these routes exist.
router = APIRouter(prefix="/v1/prices", tags=["operator"], include_in_schema=False,
                   responses=error_responses(400, 404))


@router.get("", response_model=PriceTable)
def list_prices(store: StoreDep, config: ConfigDep, _operator: OperatorDep) -> PriceTable:
    table = prices.read_price_list(store).table(config.background_price_factor,
                                                config.served_models)
    return PriceTable(data=[PriceObject.of(q) for q in table],
                      background_price_factor=config.background_price_factor)


@router.post("", response_model=PriceObject)
def set_price(body: PriceSet, store: StoreDep, _operator: OperatorDep) -> PriceObject:
    return PriceObject.of(prices.set_price(
        store, body.model, body.tier, body.input_usd_per_mtok, body.output_usd_per_mtok,
        body.cached_input_usd_per_mtok))


@router.delete("", response_model=PriceDeleted)
def delete_price(store: StoreDep, _operator: OperatorDep,
                 model: Annotated[str, Query(min_length=1, max_length=200)],
                 tier: Literal["realtime", "background"] = "realtime") -> PriceDeleted:
    prices.delete_price(store, model, tier)
    return PriceDeleted(model=model, tier=tier, deleted=True)
