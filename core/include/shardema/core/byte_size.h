#pragma once
// Sizes in bytes as people write them ("5GB", "500MB", "2GiB"), read the
// way Hugging Face's save_pretrained(max_shard_size=...) reads them, so a
// size copied from a transformers script means the same bytes here.
#include <cstdint>
#include <string>

namespace shardema {

/// Parses a byte size: plain decimal digits (bytes), or a number (an
/// integer or a decimal fraction, "1.5GB") followed by a unit, case
/// insensitive, spaces allowed between: KB, MB, GB, TB (powers of 1000, as
/// huggingface_hub's parse_size_to_int) or KiB, MiB, GiB, TiB (powers of
/// 1024, as transformers' convert_file_size_to_int). Fractions of a byte
/// are dropped, as huggingface_hub's int(value * unit) does. The result
/// must be at least 1 and fit an int64. c10::ValueError "<what> must be ...
/// got '<text>'" otherwise. Pure; any thread.
int64_t parseByteSize(const std::string& text, const std::string& what);

}  // namespace shardema
