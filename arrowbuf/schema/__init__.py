"""Experience schemas: field specs (`spec`), the schema of a step and its loading (`experience`), and the conversion
of incoming values (`convert`). See `arrowbuf.schema.experience` for the YAML layout."""

from .experience import ExperienceSchema, SchemaLike, bundled_schema_path, bundled_schemas, load_schema
from .spec import (
    DEFAULT_EPISODE_END,
    DEFAULT_TRUNCATION,
    STREAM_KEYS,
    SYSTEM_COLUMNS,
    DerivedSpec,
    FieldSpec,
)

__all__ = ["DEFAULT_EPISODE_END", "DEFAULT_TRUNCATION", "STREAM_KEYS", "SYSTEM_COLUMNS", "DerivedSpec",
           "ExperienceSchema", "FieldSpec", "SchemaLike", "bundled_schema_path", "bundled_schemas", "load_schema"]
