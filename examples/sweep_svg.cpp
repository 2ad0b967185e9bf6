#include "sweep_svg.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "shardema/core/atomic_file.h"

namespace shardema::demo {
namespace {

// Canvas and plot-area geometry in SVG user units; the legend gets the
// strip right of the plot so it never hides a point.
constexpr double kWidth = 780, kHeight = 470;
constexpr double kLeft = 80, kTop = 72, kRight = 560, kBottom = 400;
constexpr double kLegendX = 580;

const char* kSweepColor = "#1f77b4";
const char* kBestColor = "#ff7f0e";
const char* kRawColor = "#d62728";
const char* kWarmupColor = "#2ca02c";

// Sized to fit: a truncated element would make the whole file invalid XML.
template <typename... Args>
std::string format(const char* pattern, Args... args) {
  const int length = std::snprintf(nullptr, 0, pattern, args...);
  std::string text(static_cast<size_t>(std::max(length, 0)) + 1, '\0');
  std::snprintf(text.data(), text.size(), pattern, args...);
  text.pop_back();
  return text;
}

std::string escapeXml(const std::string& text) {
  std::string out;
  for (const char c : text) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

// An axis range on round numbers: lo and hi are multiples of step, and
// step is 1, 2 or 5 times a power of ten, so the tick labels read cleanly.
struct Axis {
  double lo = 0, hi = 1, step = 1;
  int decimals() const { return std::max(0, -static_cast<int>(std::floor(std::log10(step)))); }
};

double roundStep(double rough) {
  const double power = std::pow(10.0, std::floor(std::log10(rough)));
  const double fraction = rough / power;
  const double nice = fraction <= 1 ? 1 : fraction <= 2 ? 2 : fraction <= 5 ? 5 : 10;
  return nice * power;
}

// Pads [minValue, maxValue] (by the fractions of its span given) so no
// point sits on the frame, then widens it to round ticks (about `ticks` of
// them). Both plotted quantities are positive, so the padding never takes
// the axis below zero: a negative sigma_rel or MSE tick would only confuse.
Axis niceAxis(double minValue, double maxValue, double padBelow, double padAbove, int ticks) {
  const bool positive = minValue >= 0;
  if (maxValue - minValue <= 0) {
    // One value: a range of about its own size keeps the tick labels short.
    const double half = std::max(std::abs(maxValue) * 0.5, 1e-6);
    minValue -= half;
    maxValue += half;
  }
  const double span = maxValue - minValue;
  minValue -= padBelow * span;
  maxValue += padAbove * span;
  if (positive) minValue = std::max(minValue, 0.0);
  Axis axis;
  axis.step = roundStep((maxValue - minValue) / ticks);
  axis.lo = std::floor(minValue / axis.step) * axis.step;
  axis.hi = std::ceil(maxValue / axis.step) * axis.step;
  return axis;
}

std::vector<double> tickValues(const Axis& axis) {
  std::vector<double> values;
  for (int k = 0;; ++k) {
    double value = axis.lo + k * axis.step;
    if (value > axis.hi + 1e-9 * axis.step) break;
    if (std::abs(value) < 1e-9 * axis.step) value = 0;  // "0.00", not "-0.00"
    values.push_back(value);
  }
  return values;
}

class Plot {
 public:
  Plot(Axis x, Axis y) : x_(x), y_(y) {}
  double px(double value) const {
    return kLeft + (value - x_.lo) / (x_.hi - x_.lo) * (kRight - kLeft);
  }
  double py(double value) const {
    return kBottom - (value - y_.lo) / (y_.hi - y_.lo) * (kBottom - kTop);
  }
  const Axis& x() const { return x_; }
  const Axis& y() const { return y_; }

 private:
  Axis x_, y_;
};

void drawAxes(std::ostringstream& svg, const Plot& plot) {
  svg << "<g stroke=\"#e3e3e3\" stroke-width=\"1\">\n";
  for (const double v : tickValues(plot.x())) {
    svg << format("<line x1=\"%.2f\" y1=\"%.2f\" x2=\"%.2f\" y2=\"%.2f\"/>\n", plot.px(v), kTop,
                  plot.px(v), kBottom);
  }
  for (const double v : tickValues(plot.y())) {
    svg << format("<line x1=\"%.2f\" y1=\"%.2f\" x2=\"%.2f\" y2=\"%.2f\"/>\n", kLeft, plot.py(v),
                  kRight, plot.py(v));
  }
  svg << "</g>\n";
  svg << format(
      "<rect x=\"%.2f\" y=\"%.2f\" width=\"%.2f\" height=\"%.2f\" fill=\"none\" "
      "stroke=\"#333\"/>\n",
      kLeft, kTop, kRight - kLeft, kBottom - kTop);
  svg << "<g fill=\"#333\">\n";
  for (const double v : tickValues(plot.x())) {
    svg << format("<line x1=\"%.2f\" y1=\"%.2f\" x2=\"%.2f\" y2=\"%.2f\" stroke=\"#333\"/>\n",
                  plot.px(v), kBottom, plot.px(v), kBottom + 5);
    svg << format("<text x=\"%.2f\" y=\"%.2f\" text-anchor=\"middle\">%.*f</text>\n", plot.px(v),
                  kBottom + 19, plot.x().decimals(), v);
  }
  for (const double v : tickValues(plot.y())) {
    svg << format("<line x1=\"%.2f\" y1=\"%.2f\" x2=\"%.2f\" y2=\"%.2f\" stroke=\"#333\"/>\n",
                  kLeft - 5, plot.py(v), kLeft, plot.py(v));
    svg << format("<text x=\"%.2f\" y=\"%.2f\" text-anchor=\"end\">%.*f</text>\n", kLeft - 8,
                  plot.py(v) + 4, plot.y().decimals(), v);
  }
  svg << format(
      "<text x=\"%.2f\" y=\"%.2f\" text-anchor=\"middle\">sigma_rel (EMA length "
      "relative to training time)</text>\n",
      (kLeft + kRight) / 2, kBottom + 42);
  svg << format(
      "<text transform=\"translate(%.2f,%.2f) rotate(-90)\" text-anchor=\"middle\">"
      "held-out MSE</text>\n",
      kLeft - 58, (kTop + kBottom) / 2);
  svg << "</g>\n";
}

void drawReference(std::ostringstream& svg, const Plot& plot, double loss, const char* color,
                   const char* dashes) {
  svg << format(
      "<line x1=\"%.2f\" y1=\"%.2f\" x2=\"%.2f\" y2=\"%.2f\" stroke=\"%s\" "
      "stroke-width=\"1.5\" stroke-dasharray=\"%s\"/>\n",
      kLeft, plot.py(loss), kRight, plot.py(loss), color, dashes);
}

void drawSweep(std::ostringstream& svg, const Plot& plot, const std::vector<SweepRow>& rows) {
  svg << format("<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"2\" points=\"", kSweepColor);
  for (const SweepRow& row : rows) {
    svg << format("%.2f,%.2f ", plot.px(row.sigmaRel), plot.py(row.heldOutLoss));
  }
  svg << "\"/>\n";
  for (const SweepRow& row : rows) {
    // The <title> is the tooltip a browser shows on hover: exact values
    // without crowding the picture with labels.
    svg << format(
        "<circle cx=\"%.2f\" cy=\"%.2f\" r=\"3.5\" fill=\"%s\"><title>sigma_rel %g: "
        "MSE %.5f (condition number %.3g)</title></circle>\n",
        plot.px(row.sigmaRel), plot.py(row.heldOutLoss), kSweepColor, row.sigmaRel, row.heldOutLoss,
        row.conditionNumber);
  }
}

void drawBest(std::ostringstream& svg, const Plot& plot, const SweepRow& best) {
  const double x = plot.px(best.sigmaRel), y = plot.py(best.heldOutLoss);
  svg << format(
      "<circle cx=\"%.2f\" cy=\"%.2f\" r=\"8\" fill=\"none\" stroke=\"%s\" "
      "stroke-width=\"2.5\"/>\n",
      x, y, kBestColor);
  // The best point is the lowest of the curve, so the space under it is
  // free of the sweep (the y axis leaves room there); the label is centred
  // on it unless that would cross the frame's side.
  const std::string label = format("best: sigma_rel %g, MSE %.5f", best.sigmaRel, best.heldOutLoss);
  const double halfWidth = 3.6 * static_cast<double>(label.size());  // ~7.2 units a bold glyph
  const char* anchor = x - halfWidth < kLeft + 4    ? "start"
                       : x + halfWidth > kRight - 4 ? "end"
                                                    : "middle";
  const double labelX = anchor[0] == 's' ? kLeft + 4 : anchor[0] == 'e' ? kRight - 4 : x;
  svg << format(
      "<text x=\"%.2f\" y=\"%.2f\" text-anchor=\"%s\" fill=\"%s\" font-weight=\"bold\">"
      "%s</text>\n",
      labelX, std::min(y + 26, kBottom - 6), anchor, kBestColor, label.c_str());
}

void drawLegend(std::ostringstream& svg, const SweepPicture& picture, const SweepRow& best) {
  const double x = kLegendX;
  double y = kTop + 6;
  auto entryText = [&](const std::string& first, const std::string& second) {
    svg << format("<text x=\"%.2f\" y=\"%.2f\">%s</text>\n", x + 34, y + 4,
                  escapeXml(first).c_str());
    svg << format("<text x=\"%.2f\" y=\"%.2f\" fill=\"#555\">%s</text>\n", x + 34, y + 19,
                  escapeXml(second).c_str());
    y += 42;
  };
  svg << format(
      "<line x1=\"%.2f\" y1=\"%.2f\" x2=\"%.2f\" y2=\"%.2f\" stroke=\"%s\" "
      "stroke-width=\"2\"/><circle cx=\"%.2f\" cy=\"%.2f\" r=\"3.5\" fill=\"%s\"/>\n",
      x, y, x + 26, y, kSweepColor, x + 13, y, kSweepColor);
  entryText("post-hoc EMA", format("%zu sigma_rel value%s", picture.rows.size(),
                                   picture.rows.size() == 1 ? "" : "s"));
  svg << format(
      "<circle cx=\"%.2f\" cy=\"%.2f\" r=\"7\" fill=\"none\" stroke=\"%s\" "
      "stroke-width=\"2.5\"/>\n",
      x + 13, y, kBestColor);
  entryText("best sigma_rel", format("%g (%.5f)", best.sigmaRel, best.heldOutLoss));
  svg << format(
      "<line x1=\"%.2f\" y1=\"%.2f\" x2=\"%.2f\" y2=\"%.2f\" stroke=\"%s\" "
      "stroke-width=\"1.5\" stroke-dasharray=\"8 4\"/>\n",
      x, y, x + 26, y, kRawColor);
  entryText("raw weights", format("%.5f", picture.rawLoss));
  svg << format(
      "<line x1=\"%.2f\" y1=\"%.2f\" x2=\"%.2f\" y2=\"%.2f\" stroke=\"%s\" "
      "stroke-width=\"1.5\" stroke-dasharray=\"3 3\"/>\n",
      x, y, x + 26, y, kWarmupColor);
  entryText("warmup EMA", format("%.5f", picture.warmupEmaLoss));
}

}  // namespace

std::string renderSweepSvg(const SweepPicture& picture) {
  TORCH_CHECK_VALUE(!picture.rows.empty(), "renderSweepSvg: expected at least one sweep row");
  std::vector<SweepRow> rows = picture.rows;
  std::sort(rows.begin(), rows.end(),
            [](const SweepRow& a, const SweepRow& b) { return a.sigmaRel < b.sigmaRel; });
  double minLoss = std::min(picture.rawLoss, picture.warmupEmaLoss);
  double maxLoss = std::max(picture.rawLoss, picture.warmupEmaLoss);
  TORCH_CHECK_VALUE(std::isfinite(minLoss) && std::isfinite(maxLoss),
                    "renderSweepSvg: expected finite reference losses, found raw ", picture.rawLoss,
                    " and warmup EMA ", picture.warmupEmaLoss);
  const SweepRow* best = &rows.front();
  for (const SweepRow& row : rows) {
    TORCH_CHECK_VALUE(std::isfinite(row.heldOutLoss) && std::isfinite(row.sigmaRel),
                      "renderSweepSvg: expected finite values, found sigma_rel ", row.sigmaRel,
                      " with loss ", row.heldOutLoss);
    minLoss = std::min(minLoss, row.heldOutLoss);
    maxLoss = std::max(maxLoss, row.heldOutLoss);
    if (row.heldOutLoss < best->heldOutLoss) best = &row;
  }
  // Extra room under the lowest loss for the best point's label.
  const Plot plot(niceAxis(rows.front().sigmaRel, rows.back().sigmaRel, 0.05, 0.05, 6),
                  niceAxis(minLoss, maxLoss, 0.15, 0.05, 6));

  std::ostringstream svg;
  svg << "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n";
  svg << format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" "
      "viewBox=\"0 0 %.0f %.0f\" font-family=\"sans-serif\" font-size=\"12\">\n",
      kWidth, kHeight, kWidth, kHeight);
  svg << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  svg << format("<text x=\"%.2f\" y=\"30\" font-size=\"17\" font-weight=\"bold\">%s</text>\n",
                kLeft, escapeXml(picture.title).c_str());
  if (!picture.subtitle.empty()) {
    svg << format("<text x=\"%.2f\" y=\"50\" fill=\"#555\">%s</text>\n", kLeft,
                  escapeXml(picture.subtitle).c_str());
  }
  drawAxes(svg, plot);
  drawReference(svg, plot, picture.rawLoss, kRawColor, "8 4");
  drawReference(svg, plot, picture.warmupEmaLoss, kWarmupColor, "3 3");
  drawSweep(svg, plot, rows);
  drawBest(svg, plot, *best);
  drawLegend(svg, picture, *best);
  svg << "</svg>\n";
  return svg.str();
}

void writeSweepSvg(const std::string& path, const SweepPicture& picture) {
  const std::string document = renderSweepSvg(picture);
  writeFileAtomically(path, document.data(), document.size());
}

}  // namespace shardema::demo
