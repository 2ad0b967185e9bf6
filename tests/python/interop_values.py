"""The tensors both interop tests use, and the values they must hold.

tests/core/tensor_file_interop_test.cpp holds the same table and formulas;
a value is a function of the tensor's seed (its row here) and the element's
flat index, so a swapped, shifted or mis-decoded tensor cannot pass.
Every float value is a multiple of 1/8 below 32, exact in F16 and BF16.
"""
import numpy as np

# (name, safetensors dtype, shape); the seed is the row index.
TABLE = [
    ("weights.f64", "F64", (3, 5)),
    ("weights.f32", "F32", (2, 3, 4)),
    ("weights.f16", "F16", (7,)),
    ("weights.bf16", "BF16", (4, 4)),
    ("count.i64", "I64", (6,)),
    ("count.i32", "I32", (2, 5)),
    ("count.i16", "I16", (9,)),
    ("count.i8", "I8", (3, 3)),
    ("bytes.u8", "U8", (300,)),
    ("mask.bool", "BOOL", (11,)),
    ("scalar.f32", "F32", ()),
    ("empty.f32", "F32", (0, 4)),
    ("empty.bf16", "BF16", (0,)),
]

# Little-endian numpy dtypes; BF16 is carried as its uint16 bit pattern.
NUMPY_DTYPES = {
    "F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2", "I64": "<i8",
    "I32": "<i4", "I16": "<i2", "I8": "i1", "U8": "u1", "BOOL": "?",
}
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
ITEM_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4,
              "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def expected_value(seed, dtype, i):
    """The value of element i (flat, row-major) of the tensor with this seed."""
    if dtype in FLOAT_DTYPES:
        return (seed + 1) + ((i * 7) % 61 - 30) * 0.125
    if dtype == "I64":
        return (seed + 1) * 10**12 + (-1 if i % 2 else 1) * i * 987654321
    if dtype == "I32":
        return (seed + 1) * 1000000 - i * 7919
    if dtype == "I16":
        return (i * 263 + seed) % 65536 - 32768
    if dtype == "I8":
        return (i * 37 + seed) % 256 - 128
    if dtype == "U8":
        return (i * 151 + seed) % 256
    if dtype == "BOOL":
        return (i + seed) % 3 == 0
    raise ValueError("unknown dtype " + dtype)


def expected_array(seed, dtype, shape):
    """float64 for float dtypes, int64 for integers, bool for BOOL."""
    count = int(np.prod(shape, dtype=np.int64))
    values = [expected_value(seed, dtype, i) for i in range(count)]
    if dtype in FLOAT_DTYPES:
        kind = np.float64
    else:
        kind = np.bool_ if dtype == "BOOL" else np.int64
    return np.array(values, dtype=kind).reshape(shape)


def bf16_to_float32(bits):
    return (bits.astype("<u4") << 16).view("<f4")


def float32_to_bf16(values):
    """Truncation is exact here: every value fits in 8 significant bits."""
    return (values.astype("<f4").view("<u4") >> 16).astype("<u2")
