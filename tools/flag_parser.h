#pragma once
// A small --flag parser shared by the shardema subcommands.
//
// Accepted forms: `--name value`, `--name=value`, and for flags that take no
// value `--name`. Every mistake (unknown flag, flag given twice, missing
// value, bad number, stray positional argument) throws UsageError with a
// one-line message that names the flag; main() prints it as
// "shardema <command>: <message>" and exits with status 2.
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace shardema::cli {

/// A mistake on the command line; what() is one line naming the flag.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

enum class FlagArity {
  /// `--name` only, e.g. --help.
  kNone,
  /// `--name value` or `--name=value`. A following token that starts with
  /// "--" is not taken as the value (so `--a --b` reports --a's value
  /// missing); "-1" is a value.
  kValue,
  /// `--name`, `--name true|false` or `--name=true|false`: a switch that
  /// can also be spelt out explicitly.
  kOptionalBool,
};

struct FlagSpec {
  /// Without the leading dashes, e.g. "inv-gamma".
  std::string name;
  FlagArity arity = FlagArity::kValue;
};

/// The flags found on one command line, in the order given.
class ParsedFlags {
 public:
  bool has(const std::string& name) const;
  /// Names of the flags given, in order, without dashes.
  std::vector<std::string> names() const;
  /// The raw value of a kValue flag that is present (UsageError if absent).
  const std::string& text(const std::string& name) const;
  /// The value as a finite double (strtod, whole token) or UsageError.
  double number(const std::string& name) const;
  /// The value as an int64 (base 10, whole token, in range) or UsageError.
  int64_t integer(const std::string& name) const;
  /// A kNone/kOptionalBool flag: false when absent, true when given bare,
  /// else its spelt-out value.
  bool boolean(const std::string& name) const;

 private:
  friend ParsedFlags parseFlags(const std::vector<FlagSpec>&, const std::vector<std::string>&);
  const std::optional<std::string>* find(const std::string& name) const;
  std::vector<std::pair<std::string, std::optional<std::string>>> values_;
};

/// Parses args (the tokens after the subcommand name) against specs.
ParsedFlags parseFlags(const std::vector<FlagSpec>& specs, const std::vector<std::string>& args);

/// Token parsers used by ParsedFlags and by list-valued flags; `flag` (without
/// dashes) only goes into the error message.
double parseNumber(const std::string& flag, const std::string& token);
int64_t parseInteger(const std::string& flag, const std::string& token);
/// Splits "a,b,c" at `separator`; an empty item is a UsageError naming flag.
std::vector<std::string> splitList(const std::string& flag, const std::string& text,
                                   char separator);

}  // namespace shardema::cli
