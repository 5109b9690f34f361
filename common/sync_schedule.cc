#include "common/sync_schedule.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"

namespace aloe {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kMaxBruteForcePartitions = 1e7;

absl::Status CheckPositive(uint32_t value, const char* name) {
  if (value >= 1) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrFormat("%s must be >= 1, got %d", name, value));
}

absl::Status CheckCostVector(const std::vector<double>& values, const char* name, size_t k) {
  if (values.size() != k) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "unit_costs.%s has %d entries, expected %d (one per unit)", name, values.size(), k));
  }
  for (size_t u = 0; u < k; ++u) {
    if (!std::isfinite(values[u]) || values[u] < 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("unit_costs.%s[%d] must be finite and >= 0, got %g", name, u, values[u]));
    }
  }
  return absl::OkStatus();
}

// The cost model of one step, precomputed from valid costs.
class StepModel {
 public:
  explicit StepModel(const UnitCosts& costs) : transfer_(costs.transfer) {
    const size_t k = costs.forward.size();
    double forward = 0;
    for (double f : costs.forward) forward += f;
    backward_end_.resize(k);
    double end = forward;
    for (size_t u = k; u-- > 0;) {
      end += costs.backward[u];
      backward_end_[u] = end;
    }
    compute_ = k == 0 ? forward : backward_end_[0];
  }

  // F + B: a step's time when all its communication is hidden.
  double compute() const { return compute_; }

  // End of unit u's transfer when the link is busy until link_end.
  double TransferEnd(uint32_t u, double link_end) const {
    return std::max(backward_end_[u], link_end) + transfer_[u];
  }

  double Step(absl::Span<const uint32_t> units) const {
    double link_end = 0;
    for (uint32_t u : units) link_end = TransferEnd(u, link_end);
    return std::max(compute_, link_end);
  }

  // Step time of the interval of units hi, hi-1, ..., lo (empty when hi < lo).
  double Interval(int hi, int lo) const {
    double link_end = 0;
    for (int u = hi; u >= lo; --u) link_end = TransferEnd(static_cast<uint32_t>(u), link_end);
    return std::max(compute_, link_end);
  }

 private:
  const std::vector<double>& transfer_;
  std::vector<double> backward_end_;
  double compute_ = 0;
};

absl::Status CheckMatches(const UnitCosts& costs, const SyncSchedule& schedule) {
  ALOE_RETURN_IF_ERROR(ValidateUnitCosts(costs));
  ALOE_RETURN_IF_ERROR(ValidateSchedule(schedule));
  if (schedule.num_units != costs.num_units()) {
    return absl::InvalidArgumentError(absl::StrFormat("schedule has %d units, unit_costs has %d",
                                                      schedule.num_units, costs.num_units()));
  }
  return absl::OkStatus();
}

SyncSchedule EmptySchedule(uint32_t num_units, uint32_t period) {
  SyncSchedule s;
  s.num_units = num_units;
  s.period = period;
  s.syncs.resize(period);
  return s;
}

// The interval partition with counts[h] units at step h, descending across ascending steps.
SyncSchedule FromCounts(uint32_t num_units, const std::vector<uint32_t>& counts) {
  SyncSchedule s = EmptySchedule(num_units, static_cast<uint32_t>(counts.size()));
  uint32_t next = num_units;
  for (size_t h = 0; h < counts.size(); ++h) {
    for (uint32_t i = 0; i < counts[h]; ++i) s.syncs[h].push_back(--next);
  }
  return s;
}

// Depth-first search of paper 003 Algorithm 2 over interval partitions.
class DreamDdpSearch {
 public:
  DreamDdpSearch(const UnitCosts& costs, uint32_t period)
      : model_(costs),
        k_(costs.num_units()),
        h_(period),
        counts_(period, 0),
        earliest_open_(static_cast<size_t>(period) * k_, kInf) {}

  std::vector<uint32_t> Run() {
    Visit(static_cast<int>(k_) - 1, 0, 0, 0);
    return best_counts_;
  }

 private:
  // Unit u is next to place; step h holds counts_[h] units whose transfers end at link_end;
  // closed is the time of steps 0..h-1.
  void Visit(int u, uint32_t h, double link_end, double closed) {
    const double compute = model_.compute();
    const double bound =
        closed + std::max(compute, link_end) + static_cast<double>(h_ - 1 - h) * compute;
    if (bound >= best_) return;
    if (u < 0) {
      Record(bound);
      return;
    }
    if (h == h_ - 1) {
      // The last step takes every remaining unit.
      for (int v = u; v >= 0; --v) {
        link_end = model_.TransferEnd(static_cast<uint32_t>(v), link_end);
      }
      counts_[h] += static_cast<uint32_t>(u + 1);
      Record(closed + std::max(compute, link_end));
      counts_[h] -= static_cast<uint32_t>(u + 1);
      return;
    }
    const double end = model_.TransferEnd(static_cast<uint32_t>(u), link_end);
    const bool hidden = end <= compute;  // Optimal Hiding.
    const bool first = counts_[h] == 0;  // At-Least-One.
    ++counts_[h];
    Visit(u - 1, h, end, closed);
    --counts_[h];
    if (hidden || first) return;
    // Delayed CO assignment: close step h; u opens step h + 1. Steps are independent, so the
    // rest of the search from there depends only on (u, h + 1): an earlier visit that closed
    // steps 0..h in no more time already covered it.
    const double opened = closed + std::max(compute, link_end);
    double& earliest = earliest_open_[(h + 1) * k_ + static_cast<uint32_t>(u)];
    if (opened >= earliest) return;
    earliest = opened;
    Visit(u, h + 1, 0, opened);
  }

  void Record(double total) {
    if (total >= best_) return;
    best_ = total;
    best_counts_ = counts_;
  }

  StepModel model_;
  uint32_t k_;
  uint32_t h_;
  std::vector<uint32_t> counts_;
  double best_ = kInf;
  std::vector<uint32_t> best_counts_;
  // Per (step h, unit u): the least time of steps 0..h-1 with which u has opened step h.
  std::vector<double> earliest_open_;
};

}  // namespace

absl::Status ValidateUnitCosts(const UnitCosts& costs) {
  const size_t k = costs.forward.size();
  if (k == 0) return absl::InvalidArgumentError("unit_costs.forward must have >= 1 unit");
  ALOE_RETURN_IF_ERROR(CheckCostVector(costs.forward, "forward", k));
  ALOE_RETURN_IF_ERROR(CheckCostVector(costs.backward, "backward", k));
  return CheckCostVector(costs.transfer, "transfer", k);
}

std::vector<uint32_t> SyncSchedule::SyncCounts() const {
  std::vector<uint32_t> counts(num_units, 0);
  for (const auto& step : syncs) {
    for (uint32_t u : step) {
      if (u < num_units) ++counts[u];
    }
  }
  return counts;
}

std::string SyncSchedule::ToString() const {
  std::vector<std::string> steps;
  steps.reserve(syncs.size());
  for (const auto& step : syncs) steps.push_back(absl::StrCat("[", absl::StrJoin(step, " "), "]"));
  return absl::StrJoin(steps, " ");
}

absl::Status ValidateSchedule(const SyncSchedule& schedule) {
  ALOE_RETURN_IF_ERROR(CheckPositive(schedule.num_units, "schedule.num_units"));
  ALOE_RETURN_IF_ERROR(CheckPositive(schedule.period, "schedule.period"));
  if (schedule.syncs.size() != schedule.period) {
    return absl::InvalidArgumentError(absl::StrFormat("schedule.syncs has %d steps, period is %d",
                                                      schedule.syncs.size(), schedule.period));
  }
  std::vector<uint32_t> seen(schedule.num_units, 0);
  for (size_t h = 0; h < schedule.syncs.size(); ++h) {
    for (uint32_t u : schedule.syncs[h]) {
      if (u >= schedule.num_units) {
        return absl::InvalidArgumentError(
            absl::StrFormat("schedule.syncs[%d] names unit %d of %d", h, u, schedule.num_units));
      }
      if (seen[u] == h + 1) {
        return absl::InvalidArgumentError(
            absl::StrFormat("schedule.syncs[%d] lists unit %d twice", h, u));
      }
      seen[u] = static_cast<uint32_t>(h + 1);
    }
  }
  for (uint32_t u = 0; u < schedule.num_units; ++u) {
    if (seen[u] == 0) {
      return absl::InvalidArgumentError(absl::StrFormat("schedule never syncs unit %d", u));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<ScheduleKind> ParseScheduleKind(std::string_view name) {
  if (name == "strided") return ScheduleKind::kStrided;
  if (name == "enp") return ScheduleKind::kEqualNumber;
  if (name == "dreamddp") return ScheduleKind::kDreamDdp;
  return absl::InvalidArgumentError(absl::StrCat(
      "schedule must be one of strided, enp, dreamddp; got '", std::string(name), "'"));
}

std::string_view ScheduleKindName(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::kStrided:
      return "strided";
    case ScheduleKind::kEqualNumber:
      return "enp";
    case ScheduleKind::kDreamDdp:
      return "dreamddp";
  }
  return "unknown";
}

absl::StatusOr<SyncSchedule> StridedSchedule(uint32_t num_units, uint32_t period) {
  ALOE_RETURN_IF_ERROR(CheckPositive(num_units, "num_units"));
  ALOE_RETURN_IF_ERROR(CheckPositive(period, "period"));
  SyncSchedule s = EmptySchedule(num_units, period);
  for (uint32_t j = num_units; j-- > 0;) {
    const uint64_t back = static_cast<uint64_t>(num_units - 1 - j) * period / num_units;
    s.syncs[period - 1 - back].push_back(j);
  }
  return s;
}

absl::StatusOr<SyncSchedule> EqualNumberSchedule(uint32_t num_units, uint32_t period) {
  ALOE_RETURN_IF_ERROR(CheckPositive(num_units, "num_units"));
  ALOE_RETURN_IF_ERROR(CheckPositive(period, "period"));
  const uint32_t sets = std::min(num_units, period);
  std::vector<uint32_t> counts(period, 0);
  for (uint32_t i = 0; i < sets; ++i) {
    counts[i] = num_units / sets + (i < num_units % sets ? 1 : 0);
  }
  return FromCounts(num_units, counts);
}

absl::StatusOr<SyncSchedule> DreamDdpSchedule(const UnitCosts& costs, uint32_t period,
                                              bool fill_bubbles) {
  ALOE_RETURN_IF_ERROR(ValidateUnitCosts(costs));
  ALOE_RETURN_IF_ERROR(CheckPositive(period, "period"));
  SyncSchedule s = FromCounts(costs.num_units(), DreamDdpSearch(costs, period).Run());
  if (!fill_bubbles) return s;
  return FillBubbles(costs, s);
}

absl::StatusOr<SyncSchedule> BruteForceSchedule(const UnitCosts& costs, uint32_t period) {
  ALOE_RETURN_IF_ERROR(ValidateUnitCosts(costs));
  ALOE_RETURN_IF_ERROR(CheckPositive(period, "period"));
  const uint32_t k = costs.num_units();
  // C(K + H - 1, H - 1) compositions of K into H parts.
  double partitions = 1;
  for (uint32_t i = 1; i < period; ++i) partitions = partitions * (k + i) / i;
  if (partitions > kMaxBruteForcePartitions) {
    return absl::InvalidArgumentError(
        absl::StrFormat("brute force over %d units and %d steps is %g partitions, more than %g", k,
                        period, partitions, kMaxBruteForcePartitions));
  }
  const StepModel model(costs);
  std::vector<uint32_t> counts(period, 0);
  std::vector<uint32_t> best_counts;
  double best = kInf;
  // Places units hi..0 on steps h..H-1; closed is the time of steps 0..h-1.
  std::function<void(uint32_t, int, double)> place = [&](uint32_t h, int hi, double closed) {
    if (h == period - 1) {
      counts[h] = static_cast<uint32_t>(hi + 1);
      const double total = closed + model.Interval(hi, 0);
      if (total < best) {
        best = total;
        best_counts = counts;
      }
      return;
    }
    for (int c = hi + 1; c >= 0; --c) {
      counts[h] = static_cast<uint32_t>(c);
      place(h + 1, hi - c, closed + model.Interval(hi, hi - c + 1));
    }
  };
  place(0, static_cast<int>(k) - 1, 0);
  return FromCounts(k, best_counts);
}

absl::StatusOr<SyncSchedule> FillBubbles(const UnitCosts& costs, const SyncSchedule& schedule) {
  ALOE_RETURN_IF_ERROR(CheckMatches(costs, schedule));
  const StepModel model(costs);
  SyncSchedule filled = schedule;
  for (auto& step : filled.syncs) {
    const double base = model.Step(step);
    std::vector<uint32_t> trial;
    for (uint32_t u = schedule.num_units; u-- > 0;) {
      if (std::find(step.begin(), step.end(), u) != step.end()) continue;
      trial = step;
      trial.push_back(u);
      std::sort(trial.begin(), trial.end(), std::greater<uint32_t>());
      if (model.Step(trial) <= base) step = std::move(trial);
    }
  }
  return filled;
}

absl::StatusOr<SyncSchedule> MakeSchedule(ScheduleKind kind, const UnitCosts& costs,
                                          uint32_t period, bool fill_bubbles) {
  ALOE_RETURN_IF_ERROR(ValidateUnitCosts(costs));
  SyncSchedule s;
  switch (kind) {
    case ScheduleKind::kStrided: {
      ALOE_ASSIGN_OR_RETURN(s, StridedSchedule(costs.num_units(), period));
      break;
    }
    case ScheduleKind::kEqualNumber: {
      ALOE_ASSIGN_OR_RETURN(s, EqualNumberSchedule(costs.num_units(), period));
      break;
    }
    case ScheduleKind::kDreamDdp: {
      ALOE_ASSIGN_OR_RETURN(s, DreamDdpSchedule(costs, period, /*fill_bubbles=*/false));
      break;
    }
  }
  if (!fill_bubbles) return s;
  return FillBubbles(costs, s);
}

absl::StatusOr<double> StepSeconds(const UnitCosts& costs, absl::Span<const uint32_t> units) {
  ALOE_RETURN_IF_ERROR(ValidateUnitCosts(costs));
  for (uint32_t u : units) {
    if (u >= costs.num_units()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("unit %d out of range, unit_costs has %d", u, costs.num_units()));
    }
  }
  return StepModel(costs).Step(units);
}

absl::StatusOr<double> PeriodSeconds(const UnitCosts& costs, const SyncSchedule& schedule) {
  ALOE_ASSIGN_OR_RETURN(std::vector<double> overflow, StepOverflowSeconds(costs, schedule));
  const double compute = StepModel(costs).compute();
  double total = 0;
  for (double o : overflow) total += compute + o;
  return total;
}

absl::StatusOr<std::vector<double>> StepOverflowSeconds(const UnitCosts& costs,
                                                        const SyncSchedule& schedule) {
  ALOE_RETURN_IF_ERROR(CheckMatches(costs, schedule));
  const StepModel model(costs);
  std::vector<double> overflow;
  overflow.reserve(schedule.period);
  for (const auto& step : schedule.syncs) overflow.push_back(model.Step(step) - model.compute());
  return overflow;
}

absl::StatusOr<UnitCosts> UnitCostsFromProfile(double step_seconds,
                                               absl::Span<const uint64_t> unit_params,
                                               double bytes_per_value, const LinkProfile& link) {
  auto bad = [](const char* name, const char* requirement, double value) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s must be finite and %s, got %g", name, requirement, value));
  };
  if (!std::isfinite(step_seconds) || step_seconds < 0) {
    return bad("step_seconds", ">= 0", step_seconds);
  }
  if (unit_params.empty()) return absl::InvalidArgumentError("unit_params must not be empty");
  if (!std::isfinite(bytes_per_value) || bytes_per_value <= 0) {
    return bad("bytes_per_value", "> 0", bytes_per_value);
  }
  if (!std::isfinite(link.bytes_per_second) || link.bytes_per_second <= 0) {
    return bad("link.bytes_per_second", "> 0", link.bytes_per_second);
  }
  if (!std::isfinite(link.round_trip_seconds) || link.round_trip_seconds < 0) {
    return bad("link.round_trip_seconds", ">= 0", link.round_trip_seconds);
  }
  double total = 0;
  for (uint64_t p : unit_params) total += static_cast<double>(p);
  const size_t k = unit_params.size();
  UnitCosts costs;
  costs.forward.reserve(k);
  costs.backward.reserve(k);
  costs.transfer.reserve(k);
  for (uint64_t p : unit_params) {
    const double share = total > 0 ? static_cast<double>(p) / total : 1.0 / static_cast<double>(k);
    costs.forward.push_back(step_seconds / 3 * share);
    costs.backward.push_back(step_seconds * 2 / 3 * share);
    costs.transfer.push_back(link.round_trip_seconds +
                             2 * static_cast<double>(p) * bytes_per_value / link.bytes_per_second);
  }
  return costs;
}

}  // namespace aloe
