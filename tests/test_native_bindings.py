"""The typed table of the native library's functions (kernels/cpu/bindings.py) and the ctypes
mirrors of decode_step.c's structs (kernels/cpu/decode_step_structs.py) against the C itself:
the same parameters and fields, by name, type and order."""
from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest

from pagedgen.kernels.cpu import bindings, decode_step_structs, native

C_FOLDER = Path(native.__file__).parent
_CTYPE_OF = {"int64_t": ctypes.c_int64, "int": ctypes.c_int, "float": ctypes.c_float,
             "int32_t": ctypes.c_int32}


def _c_source() -> str:
    text = "\n".join(path.read_text() for path in sorted(C_FOLDER.glob("*.c")))
    return re.sub(r"/\*.*?\*/", "", text, flags=re.S)  # comments may hold commas and ';'


def _declarators(declaration: str) -> list[tuple[str, type]]:
    """'const uint16_t *a, *b' -> [(a, c_void_p), (b, c_void_p)]; 'int n' -> [(n, c_int)]."""
    base, *rest = [part.strip() for part in declaration.split(",")]
    words = base.replace("*", " * ").split()
    c_type = next(word for word in words if word not in ("const", "*"))
    found = []
    for item in [" ".join(words[words.index(c_type) + 1:])] + rest:
        pointer, name = "*" in item, item.replace("*", "").strip()
        found.append((name, ctypes.c_void_p if pointer else _CTYPE_OF[c_type]))
    return found


def _c_function(name: str) -> list[tuple[str, type]]:
    match = re.search(rf"^int\s+{name}\s*\(([^)]*)\)\s*\{{", _c_source(), re.M)
    assert match, f"no definition of {name} in kernels/cpu/*.c"
    params = " ".join(match.group(1).split())
    if params == "void":
        return []
    return [pair for param in params.split(",") for pair in _declarators(param)]


@pytest.mark.parametrize("name", sorted(bindings.FUNCTIONS))
def test_each_bound_function_matches_its_c_definition(name):
    function = bindings.FUNCTIONS[name]
    table = [(param.name, bindings.CTYPES[param.ctype]) for param in function.params]
    assert table == _c_function(name)


def _c_struct(name: str) -> list[tuple[str, type]]:
    match = re.search(r"typedef struct \{([^{}]*)\}\s*" + name + ";", _c_source())
    assert match, f"no struct {name} in kernels/cpu/*.c"
    statements = [s.strip() for s in match.group(1).split(";") if s.strip()]
    return [pair for statement in statements for pair in _declarators(statement)]


@pytest.mark.parametrize("struct", [decode_step_structs.DecodeLayerWeights,
                                    decode_step_structs.DecodeKVGroup,
                                    decode_step_structs.DecodeModelShape,
                                    decode_step_structs.DecodeStepBuffers])
def test_struct_mirrors_match_decode_step_c(struct):
    assert list(struct._fields_) == _c_struct(struct.__name__)


def test_the_library_is_bound_from_the_table():
    library = native.load()
    if library is None:
        pytest.skip("no native library here")
    for name, function in bindings.FUNCTIONS.items():
        assert getattr(library, name).argtypes == function.argtypes
