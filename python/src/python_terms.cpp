#include "python_terms.h"

#include <cctype>
#include <map>
#include <regex>

namespace shardema::python {
namespace {

// lowerCamelCase -> snake_case: the one-name rule of API_NAMES.md.
std::string snakeCase(const std::string& name) {
  std::string out;
  for (char c : name) {
    if (std::isupper(static_cast<unsigned char>(c))) {
      out += '_';
      out += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    } else {
      out += c;
    }
  }
  return out;
}

}  // namespace

const std::vector<std::pair<std::string, std::string>>& pythonTermsTable() {
  // Phrases first (they contain names the later rows would rewrite), then
  // the names whose Python form is not their snake_case (API_NAMES.md's
  // *reference* rows), then the files and factories.
  static const std::vector<std::pair<std::string, std::string>> table = {
      {"call Averager::fence() (EmaCallback::onBeforeOptimizerStep()) before optimizer.step()",
       "call fence() before that write"},
      {"Restore a saved state with loadState() or load() to continue",
       "Restore it with load_state_dict() or load_checkpoint() to continue"},
      {"restore a saved state with loadState() or load() to continue",
       "restore it with load_state_dict() or load_checkpoint() to continue"},
      {"build it with the saved schedule or load non-strictly",
       "build the EMA with the saved schedule"},
      {"build it with the saved schedules or load non-strictly",
       "build the EMA with the saved schedules="},
      {"use the same TrackingPolicy or load non-strictly", "build the EMA with the same policy="},
      {"Averager::loadState", "shardema.EMA.load_state_dict"},
      {"Averager::state", "shardema.EMA.state_dict"},
      {"Averager::ema", "shardema.EMA"},
      {"ShardedAverager::followReplaced", "shardema.EMA"},
      {"ShardedAverager::rebindLocal", "shardema.EMA"},
      {"Averager::rebindSource", "shardema.EMA"},
      {"PythonEma", "shardema.EMA"},
      {"UpdatePipeline", "shardema.EMA"},
      {"reshardCheckpoint", "`shardema export --world-size`"},
      {"exportCheckpoint", "`shardema export`"},
      {"inspectCheckpoint", "`shardema inspect`"},
      {"loadCheckpoint", "shardema.EMA.load_checkpoint"},
      {"saveCheckpoint", "shardema.EMA.save_checkpoint"},
      {"DecaySchedule::powerFunction", "shardema.DecaySchedule.power_function"},
      {"DecaySchedule::fromJson", "shardema.DecaySchedule.from_json"},
      {"DecaySchedule::decayAt", "shardema.DecaySchedule.decay_at"},
      {"DecaySchedule::isDueAt", "shardema.DecaySchedule.is_due_at"},
      {"DecaySchedule::constant", "shardema.DecaySchedule.constant"},
      {"DecaySchedule::warmup", "shardema.DecaySchedule.warmup"},
      {"PostHocCallback::onTrainBatchEnd", "shardema.PostHocEMA.update"},
      {"PostHocCallback", "the post-hoc EMA"},
      {"this Averager", "this EMA"},
      {"(refuseNonFinite)", "(refuse_non_finite=True)"},
      {"ShardedAverager: ", "shardema.EMA: "},
      {"Averager: ", "shardema.EMA: "},
  };
  return table;
}

std::string inPythonTerms(const std::string& message) {
  std::string out = message;
  for (const auto& [cpp, python] : pythonTermsTable()) {
    for (size_t at = out.find(cpp); at != std::string::npos; at = out.find(cpp, at)) {
      // Whole words only: "Averager::state" must not eat "...stateDict".
      const size_t end = at + cpp.size();
      const bool wordEnd = end >= out.size() || !std::isalnum(static_cast<unsigned char>(out[end]));
      const bool wordStart = at == 0 || !std::isalnum(static_cast<unsigned char>(out[at - 1]));
      if (wordStart && (wordEnd || cpp.back() == ' ')) {
        out.replace(at, cpp.size(), python);
        at += python.size();
      } else {
        at = end;
      }
    }
  }
  // Any other member of the averagers: shardema.EMA's snake_case one.
  static const std::regex member(R"(\b(?:Sharded)?Averager::([a-zA-Z]+)(\(\))?)");
  std::string result;
  auto begin = std::sregex_iterator(out.begin(), out.end(), member);
  size_t last = 0;
  for (auto it = begin; it != std::sregex_iterator(); ++it) {
    result += out.substr(last, static_cast<size_t>(it->position()) - last);
    result += "shardema.EMA." + snakeCase((*it)[1].str()) + (*it)[2].str();
    last = static_cast<size_t>(it->position() + it->length());
  }
  result += out.substr(last);
  // "shardema.EMA.wait: shardema.EMA: ..." (a call's prefix over its
  // engine's) says the API once.
  // c10's dtype names where a message shows a tensor's dtype: "got
  // Double" is "got torch.float64".
  static const std::regex dtype(
      R"(\b(got|is|from|to) (Double|Float|Half|BFloat16|Long|Int|Short|Char|Byte|Bool)\b)");
  static const std::map<std::string, std::string> torchName = {
      {"Double", "torch.float64"}, {"Float", "torch.float32"}, {"Half", "torch.float16"},
      {"BFloat16", "torch.bfloat16"}, {"Long", "torch.int64"}, {"Int", "torch.int32"},
      {"Short", "torch.int16"}, {"Char", "torch.int8"}, {"Byte", "torch.uint8"},
      {"Bool", "torch.bool"}};
  {
    std::string named;
    size_t at = 0;
    for (auto it = std::sregex_iterator(result.begin(), result.end(), dtype);
         it != std::sregex_iterator(); ++it) {
      named += result.substr(at, static_cast<size_t>(it->position()) - at);
      named += (*it)[1].str() + " " + torchName.at((*it)[2].str());
      at = static_cast<size_t>(it->position() + it->length());
    }
    result = named + result.substr(at);
  }
  static const std::regex twice(R"((shardema\.EMA\.[a-z_]+: )shardema\.EMA: )");
  return std::regex_replace(result, twice, "$1");
}

}  // namespace shardema::python
