//! Fast reading of a privacy ledger file (McMahan et al. 2018, §6): the complete lines of a
//! JSON-lines ledger, validated by the same rules as the Python reader
//! (`python/dpcore/ledger/_storage.py`), turned into runs of identical samples.
//!
//! This is a fast path only. Anything it does not accept, it refuses with the line number,
//! and the Python reader (the reference, which names the problem) reads the file instead.
//! So it may refuse more than Python does (escaped strings, duplicate keys, integers written
//! as 1.0), never less. The torn last line (no newline) is left to Python as well.

use serde::{Deserialize, Deserializer};

pub const FORMAT: &str = "dpcore-privacy-ledger";
pub const VERSION: u64 = 1;

/// Sampling policies, in the order of `POLICIES` in the Python reader.
pub const POLICIES: [&str; 3] = ["poisson", "fixed_size_without_replacement", "shuffle"];
const FIXED_SIZE: u8 = 1;

const INT_LIMIT: u64 = 1 << 63;
// Above 2^53 an integer ratio b/n may round differently from Python's correctly rounded one.
const EXACT_LIMIT: u64 = 1 << 53;

/// A key that may be missing, null, or hold a value (Python checks key sets exactly).
#[derive(Debug, Default)]
enum Field<T> {
    #[default]
    Missing,
    Null,
    Val(T),
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Field<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(match Option::<T>::deserialize(d)? {
            None => Field::Null,
            Some(v) => Field::Val(v),
        })
    }
}

impl<T> Field<T> {
    fn present(&self) -> bool {
        !matches!(self, Field::Missing)
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Raw<'a> {
    #[serde(rename = "type", default, borrow)]
    kind: Field<&'a str>,
    #[serde(default)]
    sample: Field<u64>,
    #[serde(default)]
    population_size: Field<u64>,
    #[serde(default)]
    sampling_probability: Field<f64>,
    #[serde(default, borrow)]
    policy: Field<&'a str>,
    #[serde(default)]
    sample_size: Field<u64>,
    #[serde(default)]
    seeded: Field<bool>,
    #[serde(default)]
    l2_norm_clip: Field<f64>,
    #[serde(default)]
    stddev: Field<f64>,
    #[serde(default)]
    line: Field<u64>,
    #[serde(default)]
    fragment: Field<String>,
    #[serde(default, borrow)]
    format: Field<&'a str>,
    #[serde(default)]
    version: Field<u64>,
    #[serde(default)]
    privacy_unit: Field<String>,
}

impl Raw<'_> {
    /// Exactly these keys are present (and no others: unknown keys fail to parse).
    fn keys(&self, want: &[&str]) -> bool {
        let have = [
            ("type", self.kind.present()),
            ("sample", self.sample.present()),
            ("population_size", self.population_size.present()),
            ("sampling_probability", self.sampling_probability.present()),
            ("policy", self.policy.present()),
            ("sample_size", self.sample_size.present()),
            ("seeded", self.seeded.present()),
            ("l2_norm_clip", self.l2_norm_clip.present()),
            ("stddev", self.stddev.present()),
            ("line", self.line.present()),
            ("fragment", self.fragment.present()),
            ("format", self.format.present()),
            ("version", self.version.present()),
            ("privacy_unit", self.privacy_unit.present()),
        ];
        have.iter().all(|(k, p)| *p == want.contains(k))
    }
}

/// Consecutive samples identical in everything but their ids.
#[derive(Debug, Clone, PartialEq)]
pub struct Run {
    pub first_sample: u64,
    pub count: u64,
    pub population_size: u64,
    pub sampling_probability: f64,
    pub policy: u8,
    pub sample_size: Option<u64>,
    pub seeded: bool,
    pub non_private: bool,
    /// (l2_norm_clip, stddev) of each sum query released on each of these samples.
    pub queries: Vec<(f64, f64)>,
}

impl Run {
    fn same_sample(&self, o: &Run) -> bool {
        self.population_size == o.population_size
            && self.sampling_probability.to_bits() == o.sampling_probability.to_bits()
            && self.policy == o.policy
            && self.sample_size == o.sample_size
            && self.seeded == o.seeded
            && self.non_private == o.non_private
            && self.queries.len() == o.queries.len()
            && self
                .queries
                .iter()
                .zip(&o.queries)
                .all(|(a, b)| a.0.to_bits() == b.0.to_bits() && a.1.to_bits() == b.1.to_bits())
    }
}

/// What the complete lines of a ledger hold.
#[derive(Debug, Default)]
pub struct Scan {
    pub runs: Vec<Run>,
    /// Complete lines read (the header included).
    pub lines: u64,
    /// Bytes up to the end of the last complete line.
    pub valid_bytes: u64,
    pub privacy_unit: Option<String>,
}

/// `Err(line)`: the first line (1-based) this reader does not accept.
pub fn scan(data: &[u8]) -> Result<Scan, u64> {
    let end = match data.iter().rposition(|&b| b == b'\n') {
        Some(i) => i + 1,
        None => return Ok(Scan::default()),
    };
    let mut out = Scan {
        valid_bytes: end as u64,
        ..Scan::default()
    };
    let mut cur: Option<Run> = None;
    let mut next_id: u64 = 0;
    for (i, raw) in data[..end - 1].split(|&b| b == b'\n').enumerate() {
        let lineno = i as u64 + 1;
        let r: Raw = serde_json::from_slice(raw).map_err(|_| lineno)?;
        if lineno == 1 {
            let unit_ok = match &r.privacy_unit {
                Field::Missing => true,
                Field::Val(u) => !u.is_empty(),
                Field::Null => false,
            };
            let want: &[&str] = if r.privacy_unit.present() {
                &["format", "version", "privacy_unit"]
            } else {
                &["format", "version"]
            };
            if !matches!(r.format, Field::Val(FORMAT))
                || !matches!(r.version, Field::Val(VERSION))
                || !unit_ok
                || !r.keys(want)
            {
                return Err(1);
            }
            if let Field::Val(u) = r.privacy_unit {
                out.privacy_unit = Some(u);
            }
            out.lines = 1;
            continue;
        }
        let kind = match r.kind {
            Field::Val(k) => k,
            _ => return Err(lineno),
        };
        match kind {
            "sample" => {
                let ok_keys = r.keys(&[
                    "type",
                    "sample",
                    "population_size",
                    "sampling_probability",
                    "policy",
                    "sample_size",
                    "seeded",
                ]);
                let run = sample_run(&r, next_id).filter(|_| ok_keys).ok_or(lineno)?;
                push(&mut out.runs, cur.take());
                cur = Some(run);
                next_id += 1;
            }
            "sum_query" | "non_private" => {
                let c = cur.as_mut().ok_or(lineno)?;
                let sid = match r.sample {
                    Field::Val(s) => s,
                    _ => return Err(lineno),
                };
                if sid != next_id - 1 {
                    return Err(lineno);
                }
                if kind == "sum_query" {
                    if !r.keys(&["type", "sample", "l2_norm_clip", "stddev"]) {
                        return Err(lineno);
                    }
                    let (s, sd) = match (r.l2_norm_clip, r.stddev) {
                        (Field::Val(s), Field::Val(sd)) => (s, sd),
                        _ => return Err(lineno),
                    };
                    if !(s.is_finite() && sd.is_finite() && s > 0.0 && sd >= 0.0) {
                        return Err(lineno);
                    }
                    c.queries.push((s, sd));
                } else {
                    if !r.keys(&["type", "sample"]) {
                        return Err(lineno);
                    }
                    c.non_private = true;
                }
            }
            "torn_tail_repaired" => {
                if !r.keys(&["type", "line", "fragment"])
                    || !matches!(r.line, Field::Val(l) if (1..INT_LIMIT).contains(&l))
                    || !matches!(r.fragment, Field::Val(_))
                {
                    return Err(lineno);
                }
            }
            _ => return Err(lineno),
        }
        out.lines = lineno;
    }
    if out.lines == 0 {
        return Err(1);
    }
    push(&mut out.runs, cur.take());
    Ok(out)
}

fn push(runs: &mut Vec<Run>, s: Option<Run>) {
    let Some(s) = s else { return };
    if let Some(last) = runs.last_mut() {
        if last.same_sample(&s) {
            last.count += 1;
            return;
        }
    }
    runs.push(s);
}

/// The sample entry's checks (`_sample_entry` in Python); None if any fails.
fn sample_run(r: &Raw, expected_id: u64) -> Option<Run> {
    let Field::Val(sid) = r.sample else {
        return None;
    };
    if sid != expected_id {
        return None;
    }
    let Field::Val(pol) = r.policy else {
        return None;
    };
    let policy = POLICIES.iter().position(|p| *p == pol)? as u8;
    let Field::Val(seeded) = r.seeded else {
        return None;
    };
    let Field::Val(n) = r.population_size else {
        return None;
    };
    if !(1..EXACT_LIMIT).contains(&n) {
        return None;
    }
    let b = match r.sample_size {
        Field::Val(b) if b <= n => Some(b),
        Field::Null => None,
        _ => return None,
    };
    let q_given = match r.sampling_probability {
        Field::Val(q) if (0.0..=1.0).contains(&q) => Some(q),
        Field::Null => None,
        _ => return None,
    };
    let q = if policy == FIXED_SIZE {
        let q = b? as f64 / n as f64;
        if q_given.is_some_and(|g| g != q) {
            return None;
        }
        q
    } else {
        match q_given {
            Some(q) => q,
            None => b? as f64 / n as f64,
        }
    };
    Some(Run {
        first_sample: sid,
        count: 1,
        population_size: n,
        sampling_probability: q,
        policy,
        sample_size: b,
        seeded,
        non_private: false,
        queries: Vec::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEADER: &str = "{\"format\": \"dpcore-privacy-ledger\", \"version\": 1}\n";

    fn sample(i: u64, q: f64) -> String {
        format!(
            "{{\"type\": \"sample\", \"sample\": {i}, \"population_size\": 1000, \"sampling_probability\": {q}, \
             \"policy\": \"poisson\", \"sample_size\": null, \"seeded\": false}}\n\
             {{\"type\": \"sum_query\", \"sample\": {i}, \"l2_norm_clip\": 1.0, \"stddev\": 1.1}}\n"
        )
    }

    #[test]
    fn identical_samples_form_one_run() {
        let mut s = HEADER.to_string();
        for i in 0..5 {
            s += &sample(i, 0.01);
        }
        for i in 5..7 {
            s += &sample(i, 0.02);
        }
        let r = scan(s.as_bytes()).unwrap();
        assert_eq!(r.lines, 15);
        assert_eq!(r.valid_bytes, s.len() as u64);
        assert_eq!(r.runs.len(), 2);
        assert_eq!((r.runs[0].first_sample, r.runs[0].count), (0, 5));
        assert_eq!((r.runs[1].first_sample, r.runs[1].count), (5, 2));
        assert_eq!(r.runs[1].queries, vec![(1.0, 1.1)]);
    }

    #[test]
    fn refuses_what_python_refuses_with_the_line() {
        let good = HEADER.to_string() + &sample(0, 0.01);
        assert!(scan(good.as_bytes()).is_ok());
        // out-of-sequence id, q out of range, a missing key, an unknown key, a bool as a number
        let cases = [
            (
                good.replace("\"sample\": 0, \"pop", "\"sample\": 1, \"pop"),
                2,
            ),
            (good.replace("0.01", "1.5"), 2),
            (good.replace(", \"seeded\": false", ""), 2),
            (
                good.replace("\"stddev\": 1.1", "\"stddev\": 1.1, \"x\": 1"),
                3,
            ),
            (good.replace("\"stddev\": 1.1", "\"stddev\": true"), 3),
            (
                good.replace("\"l2_norm_clip\": 1.0", "\"l2_norm_clip\": 0"),
                3,
            ),
            (good.replace("\"version\": 1", "\"version\": 2"), 1),
            (
                good.clone() + "{\"type\": \"sum_query\", \"sample\": 0}\n",
                4,
            ),
            (good.clone() + "not json\n", 4),
        ];
        for (text, line) in cases {
            assert_eq!(scan(text.as_bytes()).unwrap_err(), line, "{text}");
        }
    }

    #[test]
    fn the_torn_tail_is_left_out() {
        let s = HEADER.to_string() + &sample(0, 0.01) + "{\"type\": \"sam";
        let r = scan(s.as_bytes()).unwrap();
        assert_eq!(r.lines, 3);
        assert_eq!(r.valid_bytes as usize, s.len() - "{\"type\": \"sam".len());
    }

    #[test]
    fn privacy_unit_in_the_header() {
        let s =
            "{\"format\": \"dpcore-privacy-ledger\", \"version\": 1, \"privacy_unit\": \"user\"}\n"
                .to_string()
                + &sample(0, 0.5);
        assert_eq!(
            scan(s.as_bytes()).unwrap().privacy_unit.as_deref(),
            Some("user")
        );
    }
}
