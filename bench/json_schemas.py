"""JSON schemas the structured-output benchmarks compile and decode, each with a document that
satisfies it: what OpenAI clients send for Pydantic models of growing size (`model_json_schema()`
with `additionalProperties: false` on every object, as `strict` json_schema requires), and
json_object mode's schema."""

from __future__ import annotations

import json
from enum import Enum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

STRICT = ConfigDict(extra="forbid")


class Person(BaseModel):
    model_config = STRICT
    name: str
    age: int
    email: str


class Address(BaseModel):
    model_config = STRICT
    street: str
    city: str
    postcode: str


class Customer(BaseModel):
    model_config = STRICT
    name: str
    address: Address


class Item(BaseModel):
    model_config = STRICT
    sku: str
    quantity: int = Field(ge=1)
    price: float


class Order(BaseModel):
    model_config = STRICT
    id: int
    customer: Customer
    items: list[Item]
    status: Literal["pending", "shipped", "delivered"]


class Colour(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Product(BaseModel):
    model_config = STRICT
    title: str = Field(min_length=1, max_length=80)
    sku: str = Field(pattern=r"^[A-Z]{3}-[0-9]{4}$")
    colour: Colour
    tags: list[str] = Field(max_length=8)
    in_stock: bool
    rating: float = Field(ge=0, le=5)
    released: str = Field(json_schema_extra={"format": "date"})
    dimensions: dict[str, float]
    supplier: Person | None
    variants: list[Item]
    notes: str | None


DOCUMENTS: dict[str, tuple[dict, dict]] = {
    "json_object": ({"type": "object"}, {"answer": "Paris", "confidence": 0.9, "sources": ["atlas"]}),
    "flat": (Person.model_json_schema(), {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com"}),
    "nested": (
        Order.model_json_schema(),
        {
            "id": 1042,
            "customer": {"name": "Grace", "address": {"street": "1 Main St", "city": "Arlington", "postcode": "22201"}},
            "items": [
                {"sku": "ABC-1234", "quantity": 2, "price": 9.5},
                {"sku": "XYZ-0001", "quantity": 1, "price": 120},
            ],
            "status": "shipped",
        },
    ),
    "wide": (
        Product.model_json_schema(),
        {
            "title": "Desk lamp",
            "sku": "LMP-0420",
            "colour": "green",
            "tags": ["light", "office"],
            "in_stock": True,
            "rating": 4.5,
            "released": "2024-03-01",
            "dimensions": {"height": 40.0, "width": 12.5},
            "supplier": {"name": "Lumen Ltd", "age": 12, "email": "sales@lumen.example"},
            "variants": [{"sku": "LMP-0421", "quantity": 3, "price": 29.9}],
            "notes": None,
        },
    ),
}


def document_text(name: str) -> str:
    """The document as a model would write it (json.dumps spacing)."""
    return json.dumps(DOCUMENTS[name][1])
