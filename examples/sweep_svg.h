#pragma once
// The post-hoc sweep as a picture: a self-contained SVG (no scripts, fonts
// or external references) that any browser or image viewer opens, so a user
// sees at a glance which sigma_rel is best and by how much it beats the raw
// weights and the warmup EMA.
#include <string>
#include <vector>

#include "posthoc_sweep.h"

namespace shardema::demo {

struct SweepPicture {
  /// Title line at the top; plain text (escaped here).
  std::string title = "Post-hoc EMA sweep";
  /// Second line under the title, e.g. the run's settings; may be empty.
  std::string subtitle;
  /// The sweep, drawn in sigma_rel order (sorted here, not by the caller).
  std::vector<SweepRow> rows;
  /// Held-out loss of the raw weights and of the warmup EMA: dashed
  /// horizontal reference lines.
  double rawLoss = 0;
  double warmupEmaLoss = 0;
};

/// The SVG document (UTF-8 text, ASCII only). `picture.rows` must not be
/// empty; losses must be finite (c10::ValueError otherwise).
std::string renderSweepSvg(const SweepPicture& picture);

/// renderSweepSvg written crash-safely (temp file, fsync, rename), so a
/// viewer never opens half a file. c10::Error naming the path. Blocks.
void writeSweepSvg(const std::string& path, const SweepPicture& picture);

}  // namespace shardema::demo
