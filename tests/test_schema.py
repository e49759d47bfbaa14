import numpy as np
import pyarrow as pa
import pytest
import yaml

import arrowbuf as ab
from conftest import SCHEMAS, SMALL


@pytest.mark.parametrize("path", sorted(SCHEMAS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_schema_file_loads(path):
    schema = ab.load_schema(path)
    assert isinstance(schema, ab.ExperienceSchema)
    arrow = schema.to_arrow()
    assert {"episode_id", "step", "seq"} <= set(arrow.names)
    # dict and pa.Schema forms round-trip
    assert ab.load_schema(schema.to_dict()) == schema
    back = ab.load_schema(arrow)
    assert back.fields == schema.fields and back.derived == schema.derived
    assert back.episode_end == schema.episode_end


def test_atari_layout():
    s = ab.load_schema(SCHEMAS / "atari.yaml")
    assert s.fields["obs"].shape == (4, 84, 84) and s.fields["obs"].dtype == np.uint8
    assert s.derived["next_obs"].next_of == "obs"
    assert s.episode_end == ("terminated", "truncated")
    assert isinstance(s.to_arrow().field("obs").type, pa.FixedShapeTensorType)


def test_tokens_is_ragged():
    s = ab.load_schema(SCHEMAS / "tokens.yaml")
    assert s.fields["prompt_tokens"].ragged and pa.types.is_list(s.to_arrow().field("prompt_tokens").type)
    assert s.episode_end == ("done",)


def test_version_is_optional():
    d = dict(SMALL)
    d.pop("version", None)
    assert ab.load_schema(d).version is None


def test_episode_end_can_be_overridden():
    d = {**SMALL, "episode_end": ["terminated"]}
    assert ab.load_schema(d).episode_end == ("terminated",)
    d = {**SMALL, "episode_end": []}
    assert ab.load_schema(d).episode_end == ()


MALFORMED = [
    ({"name": "x"}, "fields"),
    ({"name": "x", "fields": {}}, "fields"),
    ({"name": "x", "fields": {"a": {"dtype": "complex32"}}}, "unknown dtype"),
    ({"name": "x", "fields": {"a": {"shape": [2]}}}, "missing 'dtype'"),
    ({"name": "x", "fields": {"a": {"dtype": "float32", "shape": [0]}}}, "positive integers"),
    ({"name": "x", "fields": {"a": {"dtype": "float32", "shape": "3"}}}, "positive integers"),
    ({"name": "x", "fields": {"a": {"dtype": "float32", "shpe": [3]}}}, "unknown key"),
    ({"name": "x", "fields": {"a": {"dtype": "int32", "ragged": "yes"}}}, "ragged"),
    ({"name": "x", "fields": {"a": {"dtype": "int32", "ragged": True, "shape": [2]}}}, "ragged"),
    ({"name": "x", "fields": {"a": {"dtype": "int32"}}, "derived": {"b": {"next_of": "zz"}}}, "next_of"),
    ({"name": "x", "fields": {"a": {"dtype": "int32"}}, "derived": {"b": "a"}}, "next_of"),
    ({"name": "x", "fields": {"a": {"dtype": "int32"}}, "episode_end": ["done"]}, "not a field"),
    ({"name": "x", "fields": {"a": {"dtype": "int32"}}, "episode_end": ["a"]}, "scalar bool"),
    ({"name": "x", "fields": {"seq": {"dtype": "int32"}}}, "reserved"),
    ({"name": "x", "fields": {"a": {"dtype": "int32"}}, "colour": "red"}, "unknown top-level"),
    ({"name": "", "fields": {"a": {"dtype": "int32"}}}, "name"),
]


@pytest.mark.parametrize("spec,words", MALFORMED)
def test_malformed_schema_dicts(spec, words):
    with pytest.raises(ab.SchemaError, match=words):
        ab.load_schema(spec)


def test_malformed_files(tmp_path):
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("fields: {obs: [unclosed\n")
    with pytest.raises(ab.SchemaError, match="not valid YAML"):
        ab.load_schema(bad_yaml)
    listy = tmp_path / "list.yaml"
    listy.write_text(yaml.safe_dump([1, 2]))
    with pytest.raises(ab.SchemaError, match="mapping"):
        ab.load_schema(listy)
    with pytest.raises(ab.SchemaError, match="does not exist"):
        ab.load_schema(tmp_path / "missing.yaml")
    bad_field = tmp_path / "f.yaml"
    bad_field.write_text("fields:\n  obs: {dtype: float32, shape: [-1]}\n")
    with pytest.raises(ab.SchemaError, match="obs"):
        ab.load_schema(bad_field)
    # the file name is the default schema name
    ok = tmp_path / "mine.yaml"
    ok.write_text("fields:\n  obs: {dtype: float32}\n")
    assert ab.load_schema(ok).name == "mine"


def test_schema_error_is_a_value_error():
    with pytest.raises(ValueError):
        ab.load_schema({"name": "x"})
    assert issubclass(ab.SchemaError, ab.ArrowbufError)


def test_load_schema_by_the_name_of_a_shipped_schema():
    from arrowbuf.schema import bundled_schemas

    assert {"atari", "cartpole", "mujoco", "tokens"} <= set(bundled_schemas())
    assert ab.load_schema("atari").to_dict() == ab.load_schema(SCHEMAS / "atari.yaml").to_dict()
    assert ab.load_schema("cartpole.yaml").name == "cartpole"
    for bad in ("no-such-schema", "../schemas/atari", "atari/x"):
        with pytest.raises(ab.SchemaError, match="not the name of a schema shipped"):
            ab.load_schema(bad)


# ---------------------------------------------------------------- fields filled later (issue 16)
LATER = {"name": "later", "fields": {"prompt_id": "int64", "reward": {"dtype": "float32", "later": True},
                                     "ref": {"dtype": "float32", "ragged": True, "later": True},
                                     "emb": {"dtype": "float32", "shape": [2], "later": True}, "done": "bool"}}


def test_later_fields_are_nullable_and_round_trip():
    s = ab.load_schema(LATER)
    assert s.later_fields == ["reward", "ref", "emb"] and s.fields["reward"].later
    arrow = s.to_arrow()
    assert arrow.field("reward").nullable and arrow.field("ref").nullable and arrow.field("emb").nullable
    assert not arrow.field("prompt_id").nullable and not arrow.field("seq").nullable
    assert s.sample_schema().field("reward").nullable and not s.sample_schema().field("done").nullable
    assert ab.load_schema(s.to_dict()) == s
    assert ab.load_schema(arrow).fields == s.fields
    assert ab.load_schema(yaml.safe_load(yaml.safe_dump(s.to_dict()))) == s
    direct = ab.ExperienceSchema("d", {"x": ab.FieldSpec("x", np.dtype(np.float32), later=True)})
    assert direct.later_fields == ["x"] and direct.to_arrow().field("x").nullable


def test_later_fields_may_be_left_out_or_given_with_nulls():
    s = ab.load_schema(LATER)
    cols, n = s.validate_batch({"prompt_id": [1, 2, 3], "done": [True] * 3})
    assert n == 3 and np.ma.getmaskarray(cols["reward"]).all() and cols["ref"].null_count == 3
    cols, _ = s.validate_batch({"prompt_id": [1, 2], "done": [True] * 2, "reward": [None, 2.0], "ref": [[1.0], None]})
    assert np.ma.getmaskarray(cols["reward"]).tolist() == [True, False] and cols["ref"].is_valid().to_pylist() == [
        True, False]
    rb = pa.RecordBatch.from_pydict({"prompt_id": [1, 2], "done": [True, False],
                                     "reward": pa.array([1.5, None], pa.float64())})
    cols, _ = s.validate_batch(rb)
    assert cols["reward"].tolist() == [1.5, None]
    s.check_input_types(pa.schema([("prompt_id", pa.int64()), ("done", pa.bool_())]))
    with pytest.raises(ab.SchemaError, match="later"):
        s.validate_batch({"done": [True]})  # prompt_id is not filled later: still required
    with pytest.raises(ab.SchemaError, match="reward"):  # the values given are still checked
        s.validate_batch({"prompt_id": [1, 2], "done": [True] * 2, "reward": ["a", None]})


@pytest.mark.parametrize("bad, match", [
    ({"later": "yes"}, "'later' must be true or false"),
])
def test_later_malformed(bad, match):
    d = {"name": "x", "fields": {"a": {"dtype": "float32", **bad}}}
    with pytest.raises(ab.SchemaError, match=match):
        ab.load_schema(d)


def test_later_refused_where_rows_need_it_when_written():
    with pytest.raises(ab.SchemaError, match="episode_end"):
        ab.load_schema({"name": "x", "fields": {"done": {"dtype": "bool", "later": True}}})
    with pytest.raises(ab.SchemaError, match="filled later"):
        ab.load_schema({"name": "x", "fields": {"obs": {"dtype": "float32", "later": True}},
                        "derived": {"next_obs": {"next_of": "obs"}}})


def test_grpo_schema_is_bundled():
    s = ab.load_schema("grpo")
    assert set(s.later_fields) == {"reward", "ref_logprobs"} and s.episode_end == ("done",)
    assert s.fields["response_tokens"].ragged and s.fields["prompt_id"].dtype == np.int64


def test_bool_tensor_fields_arrive_as_arrow_columns():
    """A bool field with a shape, sent as a `fixed_shape_tensor` column (a pa.Table, e.g. a restored or
    transferred batch): pyarrow's to_numpy_ndarray refuses bool tensors, the store must not."""
    schema = ab.load_schema({"name": "b", "fields": {"mask": {"dtype": "bool", "shape": [2, 3]},
                                                     "x": {"dtype": "int64"}}})
    mask = np.array([[[True, False, True], [False, False, True]]] * 2)
    col = pa.FixedShapeTensorArray.from_numpy_ndarray(mask)
    store = ab.ExperienceStore(schema, capacity=4)
    store.extend(pa.table({"mask": col, "x": [1, 2]}))
    assert np.array_equal(np.stack(store.to_table()["mask"].to_pylist()).reshape(2, 2, 3), mask)
    store.close()
