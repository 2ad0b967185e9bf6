#include "export_command.h"

#include <c10/util/Exception.h>

#include <fstream>
#include <sstream>

#include "flag_parser.h"
#include "flagged_command.h"
#include "folder_kind.h"
#include "shardema/core/byte_size.h"
#include "shardema/core/regular_file.h"
#include "shardema/sharded_checkpoint.h"
#include "snapshot_folder_listing.h"

namespace shardema::cli {

c10::ScalarType parseDtype(const std::string& text) {
  if (text == "f32") return c10::ScalarType::Float;
  if (text == "bf16") return c10::ScalarType::BFloat16;
  if (text == "f16") return c10::ScalarType::Half;
  throw UsageError("--dtype must be f32, bf16 or f16 (got '" + text + "')");
}

namespace {

ExportOptions optionsFromFlags(const ParsedFlags& flags) {
  ExportOptions options;
  if (flags.has("dtype")) options.outputDtype = parseDtype(flags.text("dtype"));
  if (flags.has("buffer-mib")) {
    const int64_t mib = flags.integer("buffer-mib");
    if (mib < 1 || mib > (int64_t{1} << 20)) {
      throw UsageError("--buffer-mib must be in [1, 1048576] (got " + std::to_string(mib) + ")");
    }
    options.bufferBytes = mib << 20;
  }
  if (flags.has("max-shard-size")) {
    try {
      options.maxShardBytes = parseByteSize(flags.text("max-shard-size"), "--max-shard-size");
    } catch (const c10::ValueError& e) {
      throw UsageError(e.what_without_backtrace());
    }
  }
  return options;
}

// --profile P: which EMA profile of a checkpoint of several (EMA(schedules=
// [...])) the deployable weights hold; a reshard keeps them all.
int profileFromFlags(const ParsedFlags& flags, const std::string& dir) {
  if (!flags.has("profile")) return 0;
  const int64_t profile = flags.integer("profile");
  const int64_t count = static_cast<int64_t>(checkpointSchedules(dir).size());
  if (profile < 0 || profile >= count) {
    throw UsageError("--profile " + std::to_string(profile) + " does not exist: " + dir +
                     " holds " + std::to_string(count) + " EMA profile" +
                     (count == 1 ? " (0)" : "s (0 to " + std::to_string(count - 1) + ")"));
  }
  return static_cast<int>(profile);
}

std::string readLayoutFile(const std::string& path) {
  // A layout is JSON of a few hundred bytes per tensor; the bound keeps a
  // hostile or wrong file (a FIFO, a huge one) from hanging or flooding us.
  try {
    return detail::readSmallRegularFile(path, "layout file", uint64_t{64} << 20);
  } catch (const c10::ValueError& e) {
    throw UsageError(std::string("--layout ") + e.what_without_backtrace());
  }
}

// Reshards to exactly the layout the new job has (ShardLayout::toJson), so
// an FSDP1 job of another world size gets its own flat-parameter ranges;
// --world-size would turn FSDP1 specs into FSDP2 ones.
int reshardToLayout(const ParsedFlags& flags, const std::string& dir, const std::string& target,
                    const ExportOptions& options, std::ostream& out) {
  if (flags.has("world-size")) throw UsageError("--layout and --world-size exclude each other");
  if (flags.has("profile"))
    throw UsageError("--profile does not apply to --layout (a checkpoint keeps every profile)");
  if (flags.has("max-shard-size"))
    throw UsageError(
        "--max-shard-size does not apply to --layout (a checkpoint has one file per rank)");
  if (flags.has("dtype"))
    throw UsageError("--dtype does not apply to --layout (states keep their dtypes)");
  const std::string& file = flags.text("layout");
  shard::ShardLayout layout;
  try {
    layout = shard::ShardLayout::fromJson(readLayoutFile(file));
  } catch (const c10::Error& error) {
    throw UsageError("--layout " + file + ": " + error.what_without_backtrace());
  }
  const ExportSummary summary = reshardCheckpoint(dir, target, layout, options);
  out << "resharded " << dir << " to " << target << ": layout of " << file << ", "
      << layout.worldSize() << " ranks, " << summary.tensors << " tensors, step " << summary.step
      << ", " << summary.bytes << " bytes\n";
  return 0;
}

// The sources export reads itself are per-rank checkpoints; the others are
// named for what they are, with what writes their deployable weights.
void checkExportSource(const std::string& dir) {
  switch (folderKind(dir)) {
    case FolderKind::kDcpCheckpoint:
      throw UsageError("--checkpoint " + dcpFolderRefusal(dir));
    case FolderKind::kPostHocSnapshots:
      throw UsageError("--checkpoint " + describeSnapshotFolder(dir) +
                       ": its EMA of any sigma_rel is `shardema synthesize --snapshots " + dir +
                       " --sigma-rel S --out FILE`");
    case FolderKind::kRankCheckpoint:
    case FolderKind::kUnknown:
      return;
  }
}

int runParsed(const ParsedFlags& flags, std::ostream& out) {
  if (!flags.has("checkpoint")) throw UsageError("--checkpoint DIR is required");
  if (!flags.has("out"))
    throw UsageError("--out is required (a file, or a folder with --world-size / --layout)");
  const std::string& dir = flags.text("checkpoint");
  const std::string& target = flags.text("out");
  checkExportSource(dir);
  const ExportOptions options = optionsFromFlags(flags);
  if (flags.has("layout")) return reshardToLayout(flags, dir, target, options, out);
  if (flags.has("world-size")) {
    if (flags.has("dtype"))
      throw UsageError("--dtype does not apply to --world-size (states keep their dtypes)");
    if (flags.has("profile")) {
      throw UsageError(
          "--profile does not apply to --world-size (a checkpoint keeps every profile)");
    }
    if (flags.has("max-shard-size")) {
      throw UsageError(
          "--max-shard-size does not apply to --world-size (a checkpoint has one file per rank)");
    }
    const int64_t worldSize = flags.integer("world-size");
    if (worldSize < 1)
      throw UsageError("--world-size must be >= 1 (got " + std::to_string(worldSize) + ")");
    // Checked before anything is written: a typo such as 100000 would
    // otherwise write that many rank files.
    const int64_t most = maxReshardWorldSize(dir);
    if (worldSize > most) {
      throw UsageError("--world-size must be at most " + std::to_string(most) +
                       ", the largest tensor's element count in " + dir + " (got " +
                       std::to_string(worldSize) + ")");
    }
    const ExportSummary summary = reshardCheckpoint(dir, target, worldSize, options);
    out << "resharded " << dir << " to " << target << ": " << worldSize << " ranks, "
        << summary.tensors << " tensors, step " << summary.step << ", " << summary.bytes
        << " bytes\n";
    return 0;
  }
  ExportOptions exported = options;
  exported.profile = profileFromFlags(flags, dir);
  const ExportSummary summary = exportCheckpoint(dir, target, exported);
  out << "exported " << dir;
  if (flags.has("profile")) out << " profile " << exported.profile;
  out << " to " << target << ": " << summary.tensors << " tensors, step " << summary.step << ", "
      << (flags.has("dtype") ? flags.text("dtype") : "f32") << ", " << summary.bytes << " bytes";
  if (options.maxShardBytes) out << " in " << summary.files << " files";
  out << "\n";
  return 0;
}

}  // namespace

void printExportUsage(std::ostream& out) {
  out << "usage: shardema export --checkpoint DIR --out FILE [--dtype f32|bf16|f16] [--profile P]\n"
         "       shardema export --checkpoint DIR --out FOLDER --max-shard-size SIZE [--dtype D]\n"
         "       shardema export --checkpoint DIR --world-size W --out NEW_DIR\n"
         "       shardema export --checkpoint DIR --layout FILE --out NEW_DIR\n\n"
         "Merges the per-rank EMA files of DIR (validated against its manifest) into one\n"
         "deployable safetensors file of full tensors, streaming; with --world-size, writes\n"
         "a checkpoint for W ranks instead (resharding; FSDP1 tensors become FSDP2 ones);\n"
         "with --layout, a checkpoint for exactly the ShardLayout JSON in FILE (what the\n"
         "new job's ShardLayout::toJson writes; use it for FSDP1 jobs). The output replaces\n"
         "FILE (or NEW_DIR's checkpoint) only once it is complete. With --max-shard-size,\n"
         "FOLDER gets Hugging Face's layout, which from_pretrained loads: files\n"
         "model-00001-of-0000N.safetensors of at most SIZE bytes of tensors and\n"
         "model.safetensors.index.json, written last (or one model.safetensors when all\n"
         "fit); a tensor larger than SIZE gets a file of its own. An EMA of several\n"
         "profiles (EMA(schedules=[...]) or beta=[...]) exports one, --profile P; a\n"
         "reshard keeps every profile.\n\n"
         "  --checkpoint DIR   per-rank checkpoint folder (manifest.json + rank files), or,\n"
         "                     from the Python package's shardema, a DCP checkpoint folder\n"
         "  --out PATH         output file, or output folder with --world-size, --layout\n"
         "                     or --max-shard-size\n"
         "  --dtype D          f32 (default), bf16 or f16 for floating tensors\n"
         "  --profile P        the EMA profile to export, of those inspect lists (default 0)\n"
         "  --world-size W     reshard to W ranks instead of merging\n"
         "  --layout FILE      reshard to the layout in FILE (ShardLayout JSON) instead\n"
         "  --buffer-mib N     bytes read per piece, in MiB (default 8)\n"
         "  --max-shard-size SIZE  split the output into files of at most SIZE: bytes,\n"
         "                     or 5GB, 500MB (powers of 1000), 2GiB (powers of 1024)\n";
}

int runExportCommand(const std::vector<std::string>& args, std::ostream& out) {
  return runFlaggedCommand({{"help", FlagArity::kNone},
                            {"checkpoint", FlagArity::kValue},
                            {"out", FlagArity::kValue},
                            {"dtype", FlagArity::kValue},
                            {"profile", FlagArity::kValue},
                            {"world-size", FlagArity::kValue},
                            {"layout", FlagArity::kValue},
                            {"buffer-mib", FlagArity::kValue},
                            {"max-shard-size", FlagArity::kValue}},
                           args, out, printExportUsage, runParsed);
}

}  // namespace shardema::cli
