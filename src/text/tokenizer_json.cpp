// tokenizer.json (Hugging Face tokenizers' serialization) and tokenizer_config.json -> TokenizerSpec.
#include <climits>
#include <filesystem>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "io/json_file.h"
#include "io/mapped_file.h"
#include "text/tokenizer_regex.h"
#include "text/tokenizer_spec.h"

namespace dflash::text {

namespace {

using nlohmann::json;

class JsonReader {
 public:
  explicit JsonReader(std::string path) : path_(std::move(path)) {}

  [[noreturn]] void fail(const std::string& what) const { throw std::runtime_error(path_ + ": " + what); }

  std::string type_of(const json& j, const std::string& component) const {
    if (!j.is_object()) fail(component + " is not a JSON object");
    if (!j.contains("type") || !j["type"].is_string()) fail(component + " has no \"type\"");
    return j["type"].get<std::string>();
  }
  bool get_bool(const json& j, const char* key, bool dflt, const std::string& component) const {
    if (!j.contains(key) || j[key].is_null()) return dflt;
    if (!j[key].is_boolean()) fail(component + ": \"" + key + "\" is not a boolean");
    return j[key].get<bool>();
  }
  std::string get_string(const json& j, const char* key, const std::string& component) const {
    if (!j.contains(key) || !j[key].is_string()) fail(component + ": \"" + key + "\" is missing or not a string");
    return j[key].get<std::string>();
  }
  [[noreturn]] void unsupported(const std::string& component, const std::string& type, const std::string& supported) const {
    fail("unsupported " + component + " type '" + type + "' (supported: " + supported + ")");
  }

  void normalizer(const json& j, TokenizerSpec& spec) const {
    if (j.is_null()) return;
    const std::string t = type_of(j, "normalizer");
    if (t == "NFC") {
      spec.nfc = true;
    } else if (t == "Sequence") {
      if (!j.contains("normalizers") || !j["normalizers"].is_array()) fail("normalizer Sequence has no \"normalizers\" array");
      for (const auto& n : j["normalizers"]) normalizer(n, spec);
    } else {
      unsupported("normalizer", t, "NFC, Sequence");
    }
  }

  // Returns true once the ByteLevel step has been seen.
  void pre_tokenizer(const json& j, TokenizerSpec& spec, bool& byte_level) const {
    const std::string t = type_of(j, "pre_tokenizer");
    if (t == "Sequence") {
      if (!j.contains("pretokenizers") || !j["pretokenizers"].is_array())
        fail("pre_tokenizer Sequence has no \"pretokenizers\" array");
      for (const auto& p : j["pretokenizers"]) pre_tokenizer(p, spec, byte_level);
    } else if (t == "Split") {
      if (byte_level) fail("pre_tokenizer Split after ByteLevel is not supported");
      if (!j.contains("pattern") || !j["pattern"].is_object()) fail("pre_tokenizer Split has no \"pattern\" object");
      const json& p = j["pattern"];
      SplitSpec s;
      if (p.contains("Regex") && p["Regex"].is_string()) {
        s.pattern = p["Regex"].get<std::string>();
      } else if (p.contains("String") && p["String"].is_string()) {
        s.pattern = p["String"].get<std::string>();
        s.literal = true;
      } else {
        fail("pre_tokenizer Split: pattern must be {\"Regex\": ...} or {\"String\": ...}");
      }
      const std::string behavior = get_string(j, "behavior", "pre_tokenizer Split");
      if (behavior != "Isolated") fail("pre_tokenizer Split: behavior '" + behavior + "' is not supported (supported: Isolated)");
      if (get_bool(j, "invert", false, "pre_tokenizer Split")) fail("pre_tokenizer Split: invert = true is not supported");
      spec.splits.push_back(std::move(s));
    } else if (t == "ByteLevel") {
      if (byte_level) fail("pre_tokenizer has two ByteLevel steps");
      if (get_bool(j, "add_prefix_space", true, "pre_tokenizer ByteLevel"))
        fail("pre_tokenizer ByteLevel: add_prefix_space = true is not supported");
      if (get_bool(j, "use_regex", true, "pre_tokenizer ByteLevel")) spec.splits.push_back({kGpt2Pattern, false});
      byte_level = true;
    } else {
      unsupported("pre_tokenizer", t, "ByteLevel, Split, Sequence");
    }
  }

  void post_processor(const json& j, TokenizerSpec& spec, bool& has_template) const {
    if (j.is_null()) return;
    const std::string t = type_of(j, "post_processor");
    if (t == "Sequence") {
      if (!j.contains("processors") || !j["processors"].is_array()) fail("post_processor Sequence has no \"processors\" array");
      for (const auto& p : j["processors"]) post_processor(p, spec, has_template);
    } else if (t == "ByteLevel") {
      spec.trim_offsets = get_bool(j, "trim_offsets", true, "post_processor ByteLevel");
      spec.post_add_prefix_space = get_bool(j, "add_prefix_space", true, "post_processor ByteLevel");
    } else if (t == "TemplateProcessing") {
      if (has_template) fail("post_processor has two TemplateProcessing steps");
      has_template = true;
      if (!j.contains("single") || !j["single"].is_array()) fail("post_processor TemplateProcessing has no \"single\" array");
      const json* specials = j.contains("special_tokens") && j["special_tokens"].is_object() ? &j["special_tokens"] : nullptr;
      bool seen_a = false;
      for (const auto& item : j["single"]) {
        if (item.contains("Sequence")) {
          const json& s = item["Sequence"];
          if (!s.is_object() || s.value("id", "") != "A")
            fail("post_processor TemplateProcessing: the single template may only hold sequence A");
          if (seen_a) fail("post_processor TemplateProcessing: sequence A twice in the single template");
          seen_a = true;
        } else if (item.contains("SpecialToken")) {
          const json& s = item["SpecialToken"];
          const std::string name = s.is_object() ? s.value("id", "") : "";
          if (!specials || !specials->contains(name) || !(*specials)[name].contains("ids") || !(*specials)[name]["ids"].is_array())
            fail("post_processor TemplateProcessing: special token '" + name + "' is not in \"special_tokens\"");
          for (const auto& id : (*specials)[name]["ids"]) {
            if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > INT32_MAX)
              fail("post_processor TemplateProcessing: id for '" + name + "' is not a token id");
            (seen_a ? spec.suffix_ids : spec.prefix_ids).push_back(id.get<int32_t>());
          }
        } else {
          fail("post_processor TemplateProcessing: unknown template item " + item.dump());
        }
      }
      if (!seen_a) fail("post_processor TemplateProcessing: the single template has no sequence A");
    } else {
      unsupported("post_processor", t, "ByteLevel, TemplateProcessing, Sequence");
    }
  }

  void decoder(const json& j, TokenizerSpec& spec) const {
    const std::string t = type_of(j, "decoder");
    DecoderStep d;
    if (t == "Sequence") {
      if (!j.contains("decoders") || !j["decoders"].is_array()) fail("decoder Sequence has no \"decoders\" array");
      for (const auto& x : j["decoders"]) decoder(x, spec);
      return;
    } else if (t == "ByteLevel") {
      d.kind = DecoderStep::ByteLevel;
    } else if (t == "ByteFallback") {
      d.kind = DecoderStep::ByteFallback;
    } else if (t == "Fuse") {
      d.kind = DecoderStep::Fuse;
    } else if (t == "Replace") {
      d.kind = DecoderStep::Replace;
      if (!j.contains("pattern") || !j["pattern"].is_object() || !j["pattern"].contains("String") ||
          !j["pattern"]["String"].is_string())
        fail("decoder Replace: only {\"String\": ...} patterns are supported");
      d.pattern = j["pattern"]["String"].get<std::string>();
      d.content = get_string(j, "content", "decoder Replace");
      if (d.pattern.empty()) fail("decoder Replace: empty pattern");
    } else if (t == "Strip") {
      d.kind = DecoderStep::Strip;
      d.content = get_string(j, "content", "decoder Strip");
      if (!j.contains("start") || !j["start"].is_number_unsigned() || !j.contains("stop") || !j["stop"].is_number_unsigned() ||
          j["start"].get<uint64_t>() > INT32_MAX || j["stop"].get<uint64_t>() > INT32_MAX)
        fail("decoder Strip: \"start\" and \"stop\" must be non-negative integers");
      d.start = j["start"].get<int>();
      d.stop = j["stop"].get<int>();
    } else {
      unsupported("decoder", t, "ByteLevel, ByteFallback, Fuse, Replace, Strip, Sequence");
    }
    spec.decoder.push_back(std::move(d));
  }

  void model(const json& m, TokenizerSpec& spec) const {
    if (!m.is_object()) fail("\"model\" is not a JSON object");
    if (m.contains("type")) {
      if (!m["type"].is_string()) fail("model \"type\" is not a string");
      const std::string t = m["type"].get<std::string>();
      if (t != "BPE") unsupported("model", t, "BPE");
    }
    if (m.contains("dropout") && !m["dropout"].is_null() && !(m["dropout"].is_number() && m["dropout"].get<double>() == 0.0))
      fail("model BPE: dropout is not supported");
    for (const char* k : {"continuing_subword_prefix", "end_of_word_suffix"})
      if (m.contains(k) && !m[k].is_null() && !(m[k].is_string() && m[k].get<std::string>().empty()))
        fail(std::string("model BPE: ") + k + " is not supported");
    if (m.contains("unk_token") && !m["unk_token"].is_null()) {
      if (!m["unk_token"].is_string()) fail("model BPE: unk_token is not a string");
      spec.unk_token = m["unk_token"].get<std::string>();
    }
    spec.fuse_unk = get_bool(m, "fuse_unk", false, "model BPE");
    spec.byte_fallback = get_bool(m, "byte_fallback", false, "model BPE");
    spec.ignore_merges = get_bool(m, "ignore_merges", false, "model BPE");
    if (!m.contains("vocab") || !m["vocab"].is_object()) fail("model BPE has no \"vocab\" object");
    spec.vocab.reserve(m["vocab"].size());
    for (const auto& [tok, id] : m["vocab"].items()) {
      if (!id.is_number_integer()) fail("model BPE: vocab entry '" + tok + "' has a non-integer id");
      const int64_t v = id.get<int64_t>();
      if (v < 0 || v > INT32_MAX) fail("model BPE: vocab entry '" + tok + "' has id " + std::to_string(v) + " out of range");
      spec.vocab.emplace_back(tok, int32_t(v));
    }
    if (!m.contains("merges") || !m["merges"].is_array()) fail("model BPE has no \"merges\" array");
    spec.merges.reserve(m["merges"].size());
    std::size_t rank = 0;
    for (const auto& x : m["merges"]) {
      ++rank;
      if (x.is_string()) {
        const std::string s = x.get<std::string>();
        const std::size_t sp = s.find(' ');
        if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
          fail("model BPE: merge " + std::to_string(rank) + " '" + s + "' is not two tokens separated by one space");
        spec.merges.emplace_back(s.substr(0, sp), s.substr(sp + 1));
      } else if (x.is_array() && x.size() == 2 && x[0].is_string() && x[1].is_string()) {
        spec.merges.emplace_back(x[0].get<std::string>(), x[1].get<std::string>());
      } else {
        fail("model BPE: merge " + std::to_string(rank) + " is neither \"a b\" nor [\"a\", \"b\"]");
      }
    }
  }

  void added_tokens(const json& j, TokenizerSpec& spec) const {
    if (j.is_null()) return;
    if (!j.is_array()) fail("\"added_tokens\" is not an array");
    for (const auto& a : j) {
      if (!a.is_object() || !a.contains("id") || !a["id"].is_number_integer() || !a.contains("content") || !a["content"].is_string())
        fail("added token without integer \"id\" and string \"content\": " + a.dump());
      AddedTokenSpec t;
      t.content = a["content"].get<std::string>();
      if (!a.contains("id") || !a["id"].is_number_integer()) fail("added token '" + t.content + "' has no integer id");
      const int64_t id = a["id"].get<int64_t>();
      if (id < 0 || id > INT32_MAX) fail("added token '" + t.content + "' has id out of range");
      t.id = int32_t(id);
      const std::string what = "added token '" + t.content + "'";
      if (t.content.empty()) fail(what + " is empty");
      for (const char* k : {"single_word", "lstrip", "rstrip"})
        if (get_bool(a, k, false, what)) fail(what + ": " + k + " = true is not supported");
      t.special = get_bool(a, "special", false, what);
      t.normalized = get_bool(a, "normalized", !t.special, what);
      spec.added.push_back(std::move(t));
    }
  }

 private:
  std::string path_;
};

std::optional<std::string> special_token_name(const json& j) {
  if (j.is_string()) return j.get<std::string>();
  if (j.is_object() && j.contains("content") && j["content"].is_string()) return j["content"].get<std::string>();
  return std::nullopt;
}

void read_config(const std::string& path, TokenizerSpec& spec) {
  const json c = read_json_file(path);
  if (!c.is_object()) throw std::runtime_error(path + ": not a JSON object");
  if (c.contains("chat_template")) {
    const json& t = c["chat_template"];
    if (t.is_string()) {
      spec.chat_template = t.get<std::string>();
    } else if (t.is_array()) {  // [{"name": ..., "template": ...}]: the "default" one, else the first
      for (const auto& x : t)
        if (x.is_object() && x.value("name", "") == "default" && x.contains("template") && x["template"].is_string())
          spec.chat_template = x["template"].get<std::string>();
      if (spec.chat_template.empty() && !t.empty() && t[0].is_object() && t[0].contains("template") && t[0]["template"].is_string())
        spec.chat_template = t[0]["template"].get<std::string>();
    }
  }
  if (c.contains("bos_token")) spec.bos_token = special_token_name(c["bos_token"]);
  if (c.contains("eos_token")) spec.eos_token = special_token_name(c["eos_token"]);
}

}  // namespace

TokenizerSpec parse_tokenizer_json(const std::string& path, const std::string& config_path) {
  TokenizerSpec spec;
  spec.origin = path;
  const json j = read_json_file(path, uint64_t(2) << 30);
  const JsonReader r(path);
  if (!j.is_object()) r.fail("not a JSON object (tokenizer.json)");
  for (const char* k : {"truncation", "padding"})
    if (j.contains(k) && !j[k].is_null()) r.fail(std::string("\"") + k + "\" is set; truncation and padding are not supported");
  if (!j.contains("model")) r.fail("no \"model\" (tokenizer.json)");
  r.model(j["model"], spec);
  if (j.contains("normalizer")) r.normalizer(j["normalizer"], spec);
  bool byte_level = false;
  if (j.contains("pre_tokenizer") && !j["pre_tokenizer"].is_null()) r.pre_tokenizer(j["pre_tokenizer"], spec, byte_level);
  if (!byte_level) r.fail("pre_tokenizer has no ByteLevel step; only byte-level BPE tokenizers are supported");
  bool has_template = false;
  if (j.contains("post_processor")) r.post_processor(j["post_processor"], spec, has_template);
  if (!j.contains("decoder") || j["decoder"].is_null()) r.fail("no \"decoder\"; a ByteLevel decoder is required");
  r.decoder(j["decoder"], spec);
  bool decoder_byte_level = false;
  for (const auto& d : spec.decoder) decoder_byte_level |= d.kind == DecoderStep::ByteLevel;
  if (!decoder_byte_level) r.fail("decoder has no ByteLevel step; only byte-level BPE tokenizers are supported");
  if (j.contains("added_tokens")) r.added_tokens(j["added_tokens"], spec);
  if (!config_path.empty() && std::filesystem::is_regular_file(config_path)) read_config(config_path, spec);
  return spec;
}

}  // namespace dflash::text
