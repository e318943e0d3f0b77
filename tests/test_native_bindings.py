"""The typed table of the native library's functions (kernels/cpu/bindings.py) and the ctypes
mirrors of decode_step.c's structs (kernels/cpu/decode_step_structs.py) and of the GGUF
projection it reads (kernels/cpu/gguf/team.py) against the C itself: the same parameters and
fields, by name, type and order."""
from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest

from pagedgen.kernels.cpu import bindings, decode_step_structs, native
from pagedgen.kernels.cpu.gguf import team as gguf_team

C_FOLDER = Path(native.__file__).parent
_CTYPE_OF = {"int64_t": ctypes.c_int64, "int": ctypes.c_int, "float": ctypes.c_float,
             "int32_t": ctypes.c_int32,
             "GgufLinearTeam": ctypes.c_void_p,  # decode_step.c's function pointer type
             "GgufPart": gguf_team.GgufPart}


def _c_source() -> str:
    paths = sorted(C_FOLDER.glob("*.c")) + sorted(C_FOLDER.glob("gguf/*.c"))
    text = "\n".join(path.read_text() for path in paths)
    return re.sub(r"/\*.*?\*/", "", text, flags=re.S)  # comments may hold commas and ';'


def _c_define(name: str) -> int:
    return int(re.search(rf"^#define\s+{name}\s+(\d+)", _c_source(), re.M).group(1))


def _declarators(declaration: str) -> list[tuple[str, type]]:
    """'const uint16_t *a, *b' -> [(a, c_void_p), (b, c_void_p)]; 'int n' -> [(n, c_int)]."""
    base, *rest = [part.strip() for part in declaration.split(",")]
    words = base.replace("*", " * ").split()
    c_type = next(word for word in words if word not in ("const", "*"))
    found = []
    for item in [" ".join(words[words.index(c_type) + 1:])] + rest:
        pointer, name = "*" in item, item.replace("*", "").strip()
        kind = ctypes.c_void_p if pointer else _CTYPE_OF[c_type]
        array = re.fullmatch(r"(\w+)\s*\[\s*(\w+)\s*\]", name)  # 'parts[GGUF_MAX_PARTS]'
        if array:
            name, kind = array.group(1), kind * _c_define(array.group(2))
        found.append((name, kind))
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
                                    decode_step_structs.DecodeStepBuffers,
                                    gguf_team.GgufPart, gguf_team.GgufProjection])
def test_struct_mirrors_match_decode_step_c(struct):
    def comparable(fields):  # ctypes makes a new class per array type: compare what it holds
        return [(name, (kind._type_, kind._length_) if issubclass(kind, ctypes.Array) else kind)
                for name, kind in fields]

    assert comparable(struct._fields_) == comparable(_c_struct(struct.__name__))


def test_the_library_is_bound_from_the_table():
    library = native.load()
    if library is None:
        pytest.skip("no native library here")
    for name, function in bindings.FUNCTIONS.items():
        assert getattr(library, name).argtypes == function.argtypes
