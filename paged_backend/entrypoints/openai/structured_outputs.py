"""A request's output format, the ways OpenAI and vLLM let clients ask for one, as one
``StructuredOutputsParams``: OpenAI's ``response_format`` (``json_object``, or ``json_schema`` with its
``schema``), vLLM's ``structured_outputs`` object, and vLLM's older ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar``. At most one of them per request (``response_format: {"type": "text"}``
asks for nothing)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from paged_backend.config import FieldError
from paged_backend.sampling_params import StructuredOutputsParams

STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, populate_by_name=True)
Choices = Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]


class JsonSchemaFormat(BaseModel):
    """OpenAI's ``response_format.json_schema``."""

    model_config = STRICT
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = Field(default=None, description="with type json_schema")

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given with type json_schema, and only then")
        return self


class StructuredOutputsFields(BaseModel):
    """vLLM's ``structured_outputs`` request field: ``StructuredOutputsParams``' fields."""

    model_config = STRICT
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: Choices | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


class StructuredOutputRequest(BaseModel):
    """The request fields that ask for an output format (mixed into both endpoints' request bodies)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsFields | None = Field(default=None, description="vLLM's")
    guided_json: dict[str, Any] | str | None = Field(default=None, description="vLLM's older name: json")
    guided_regex: str | None = Field(default=None, description="vLLM's older name: regex")
    guided_choice: Choices | None = Field(default=None, description="vLLM's older name: choice")
    guided_grammar: str | None = Field(default=None, description="vLLM's older name: grammar")

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The one output format asked for, or None; two ways at once are a ``FieldError`` naming the second."""
        asked = self._asked()
        if len(asked) > 1:
            first, second = list(asked)[:2]
            raise FieldError(second, f"{second} asks for an output format as {first} does: give one of them")
        if not asked:
            return None
        ((field, values),) = asked.items()
        try:
            return StructuredOutputsParams(**values)
        except FieldError as exc:  # named by the request's own field (``structured_outputs``' own: its sub-field)
            raise FieldError(exc.field if field == "structured_outputs" else field, f"{field}: {exc}") from None

    def output_format_field(self) -> str | None:
        """The request field the output format came from (what a grammar that does not compile is named by)."""
        return next(iter(self._asked()), None)

    def _asked(self) -> dict[str, dict[str, Any]]:
        """Each request field that asks for an output format, as ``StructuredOutputsParams`` fields."""
        asked: dict[str, dict[str, Any]] = {}
        if self.response_format is not None and self.response_format.type != "text":
            if self.response_format.json_schema is not None:
                asked["response_format"] = {"json": self.response_format.json_schema.schema_}
            else:
                asked["response_format"] = {"json_object": True}
        if self.structured_outputs is not None:  # its fields as given: a schema is not copied (it may be large)
            fields = self.structured_outputs
            asked["structured_outputs"] = {
                "json" if name == "json_" else name: getattr(fields, name)
                for name in type(fields).model_fields
                if getattr(fields, name) is not None
            }
        for name, field in (("json", "guided_json"), ("regex", "guided_regex"), ("choice", "guided_choice"),
                            ("grammar", "guided_grammar")):  # fmt: skip
            value = getattr(self, field)
            if value is not None:
                asked[field] = {name: value}
        return asked
