"""The one attribute struct of the FFI handlers, as Python builds it."""

import os
import re

import numpy as np
import pytest

from ficco_jax._src.dma import attrs

HEADER = os.path.join(os.path.dirname(__file__), "..", "xla_ffi", "attrs.h")


def test_python_names_every_field_of_the_header_in_order():
  with open(HEADER) as f:
    text = f.read()
  decoded = re.findall(r'StructMember<.*?>\("(\w+)"\)', text)
  assert tuple(decoded) == attrs.NAMES


def test_full_fills_defaults_with_ffi_types():
  out = attrs.full({"op_name": "all_gather_matmul", "window": 3,
                    "rows": [4, 5]})
  assert tuple(out) == attrs.NAMES
  assert out["op_name"] == "all_gather_matmul" and out["program"] == ""
  assert out["window"] == 3 and isinstance(out["window"], np.int64)
  assert out["site"] == -1 and out["half_bytes"] == 0
  assert out["rows"].dtype == np.int64 and out["rows"].tolist() == [4, 5]
  assert out["devices"].shape == (0,)


def test_unknown_attribute_is_a_type_error_naming_it():
  with pytest.raises(TypeError, match="'rowz'"):
    attrs.full({"rowz": [1]})
