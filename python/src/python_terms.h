#pragma once
// Messages speak Python in Python: the library's errors and warnings name
// its C++ calls ("Averager::update: ...", "restore a saved state with
// loadState() or load()"), which a Python user never called. At the one
// boundary where they cross into Python (errors.cpp's translator and
// python_warnings.h's handler), each C++ name becomes the Python name of
// the same operation, the one API_NAMES.md gives it
// (tests/python/test_api_names.py checks the table against it), and the
// few C++-only phrases their Python equivalent. Messages made for Python
// ("shardema.EMA.update: ...") pass through unchanged.
#include <string>
#include <utility>
#include <vector>

namespace shardema::python {

/// `message` with every C++ name of the table (and any other
/// "Averager::member"/"ShardedAverager::member", as shardema.EMA's
/// snake_case member) in its Python form. Pure; any thread.
std::string inPythonTerms(const std::string& message);

/// The table (C++ text, Python text), longest first, for the test that
/// holds it to API_NAMES.md (shardema._C._python_terms).
const std::vector<std::pair<std::string, std::string>>& pythonTermsTable();

}  // namespace shardema::python
