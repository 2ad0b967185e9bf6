// Local shards and their specs in Python: what shardema.EMA.from_local_shards
// takes (FSDP1 flat shards, or any layout a user describes by hand), and
// the roles of a module's tensors.
#include <torch/csrc/utils/pybind.h>

#include <string>
#include <utility>
#include <vector>

#include "bindings.h"
#include "conversions.h"
#include "dtype.h"
#include "shardema/shard/flat_param_layout.h"
#include "shardema/shard/shard_spec.h"
#include "shardema/sharded_averager.h"
#include "shardema/tracking_policy.h"

namespace py = pybind11;

namespace shardema::python {
namespace {

// ranges: [(begin, end), ...], one per rank.
std::vector<shard::ElementRange> toRanges(const std::vector<std::pair<int64_t, int64_t>>& pairs) {
  std::vector<shard::ElementRange> ranges;
  for (const auto& [begin, end] : pairs) ranges.push_back({begin, end});
  return ranges;
}

}  // namespace

void bindShards(py::module_& m) {
  m.def(
      "role_for",
      [](const std::string& policy, bool isBuffer, bool isFloating, bool requiresGrad,
         bool inBatchNorm) {
        TensorTraits traits{isBuffer, isFloating, requiresGrad, inBatchNorm};
        return std::string(trackRoleName(roleFor(parsePolicy(policy), traits)));
      },
      py::arg("policy"), py::arg("is_buffer"), py::arg("is_floating"), py::arg("requires_grad"),
      py::arg("in_batch_norm"),
      "The role ('average', 'copy', 'copy_once', 'average_if_trainable') a policy gives a tensor");

  py::class_<shard::ShardSpec>(m, "ShardSpec",
                               "How one global tensor is split: one [begin, end) range of its "
                               "flattened elements per rank")
      .def(py::init([](std::string name, std::vector<int64_t> globalShape, py::handle dtype,
                       const std::string& kind,
                       const std::vector<std::pair<int64_t, int64_t>>& ranges) {
             shard::ShardSpec spec;
             spec.name = std::move(name);
             spec.globalShape = std::move(globalShape);
             spec.dtype = scalarTypeOf(dtype, "ShardSpec: dtype");
             spec.kind = shard::parseLayoutKind(kind);
             spec.ranges = toRanges(ranges);
             shard::checkShardSpec(spec);
             return spec;
           }),
           py::arg("name"), py::arg("global_shape"), py::arg("dtype"), py::arg("kind"),
           py::arg("ranges"))
      .def_readonly("name", &shard::ShardSpec::name)
      .def_readonly("global_shape", &shard::ShardSpec::globalShape)
      .def_property_readonly("dtype",
                             [](const shard::ShardSpec& s) { return dtypeObject(s.dtype); })
      .def_property_readonly(
          "kind", [](const shard::ShardSpec& s) { return shard::layoutKindName(s.kind); })
      .def_property_readonly("ranges",
                             [](const shard::ShardSpec& s) {
                               std::vector<std::pair<int64_t, int64_t>> out;
                               for (const auto& r : s.ranges) out.emplace_back(r.begin, r.end);
                               return out;
                             })
      .def_property_readonly("world_size", &shard::ShardSpec::worldSize)
      .def("__eq__", [](const shard::ShardSpec& a, const shard::ShardSpec& b) { return a == b; })
      .def("__repr__", [](const shard::ShardSpec& s) {
        return "ShardSpec('" + s.name + "', kind='" + shard::layoutKindName(s.kind) +
               "', world_size=" + std::to_string(s.worldSize()) + ")";
      });

  m.def(
      "layout_spec",
      [](const std::string& name, const std::vector<int64_t>& shape, py::handle dtype,
         const std::string& kind, int64_t worldSize) {
        return shard::layoutSpec(name, shape, scalarTypeOf(dtype, "dtype"),
                                 shard::parseLayoutKind(kind), worldSize);
      },
      py::arg("name"), py::arg("global_shape"), py::arg("dtype"), py::arg("kind"),
      py::arg("world_size"), "The spec of a per-tensor layout: fsdp2, replicated or rank0");

  py::class_<LocalShard>(m, "LocalShard", "This rank's elements of one tensor and its spec")
      .def(py::init([](at::Tensor local, shard::ShardSpec spec, const std::string& role,
                       bool changesInForward, std::vector<std::string> aliases, int64_t splitDim,
                       bool persistent) {
             LocalShard shard{std::move(local), std::move(spec), parseTrackRole(role),
                              changesInForward};
             shard.aliases = std::move(aliases);
             shard.splitDim = splitDim;
             shard.persistent = persistent;
             return shard;
           }),
           py::arg("local"), py::arg("spec"), py::arg("role") = "average",
           py::arg("changes_in_forward") = false, py::kw_only(),
           py::arg("aliases") = std::vector<std::string>(), py::arg("split_dim") = 0,
           py::arg("persistent") = true)
      .def_readonly("local", &LocalShard::local)
      .def_readonly("spec", &LocalShard::spec)
      .def_property_readonly("role", [](const LocalShard& s) { return trackRoleName(s.role); })
      .def_readonly("changes_in_forward", &LocalShard::changesInForward)
      .def_readwrite("aliases", &LocalShard::aliases,
                     "The tensor's other names (a tied weight's further state_dict keys)")
      .def_readwrite("persistent", &LocalShard::persistent,
                     "False for a non-persistent buffer: kept and swapped, but in no "
                     "full_state_dict() or export")
      .def_readonly("split_dim", &LocalShard::splitDim,
                    "0, or d > 0 for a Shard(d) piece in its own shape (tensor parallelism)");

  m.def(
      "shards_from_full_tensors",
      [](const std::vector<std::pair<std::string, at::Tensor>>& tensors,
         const std::vector<std::string>& roles, const std::vector<bool>& changesInForward,
         const std::string& kind, int64_t rank, int64_t worldSize) {
        TORCH_CHECK_VALUE(
            roles.size() == tensors.size() && changesInForward.size() == tensors.size(),
            "shards_from_full_tensors: one role and one changes_in_forward per tensor");
        std::vector<TrackedTensor> full;
        for (size_t i = 0; i < tensors.size(); ++i) {
          full.push_back(
              {tensors[i].first, tensors[i].second, parseTrackRole(roles[i]), changesInForward[i]});
        }
        return shardsFromFullTensors(full, shard::parseLayoutKind(kind), rank, worldSize);
      },
      py::arg("tensors"), py::arg("roles"), py::arg("changes_in_forward"), py::arg("kind"),
      py::arg("rank"), py::arg("world_size"),
      "Views of `rank`'s rows of full tensors (fsdp2 / replicated / rank0 layouts)");

  py::class_<shard::FlatParamLayout>(m, "FlatParamLayout",
                                     "FSDP1's FlatParameter layout of one FSDP unit")
      .def(py::init([](const std::vector<std::pair<std::string, std::vector<int64_t>>>& members,
                       py::handle dtype, int64_t worldSize, bool useOrigParams) {
             std::vector<shard::FlatParamMember> list;
             for (const auto& [name, shape] : members) list.push_back({name, shape});
             shard::FlatParamOptions options;
             options.useOrigParams = useOrigParams;
             return shard::FlatParamLayout(std::move(list), scalarTypeOf(dtype, "dtype"), worldSize,
                                           options);
           }),
           py::arg("members"), py::arg("dtype"), py::arg("world_size"),
           py::arg("use_orig_params") = true)
      .def_property_readonly("shard_numel", &shard::FlatParamLayout::shardNumel)
      .def_property_readonly("padded_numel", &shard::FlatParamLayout::paddedNumel)
      .def_property_readonly("unpadded_numel", &shard::FlatParamLayout::unpaddedNumel)
      .def("specs", &shard::FlatParamLayout::specs)
      .def(
          "shards_from_flat_param",
          [](const shard::FlatParamLayout& layout, const at::Tensor& flatShard, int64_t rank,
             const std::string& role) {
            return shardsFromFlatParam(layout, flatShard, rank, parseTrackRole(role));
          },
          py::arg("flat_shard"), py::arg("rank"), py::arg("role") = "average",
          "Views into this rank's 1-D flat shard, one LocalShard per member piece");
}

}  // namespace shardema::python
