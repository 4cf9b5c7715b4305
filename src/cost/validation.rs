//! Validating the model against measurements: the points of the kernel benchmark's grid
//! (`benches/kernels.rs --cost-model`, its CSV) and their assessment: how often the algorithm
//! the model predicts fastest is within 10% of the fastest measured, the worst regret, and the
//! median |predicted − measured| / measured.

use crate::device::measure::median;
use crate::device::{DeviceAlgorithm, KeyWidth};

use super::model::{Case, CostModel};

/// One measured selection of the grid.
#[derive(Debug, Clone, PartialEq)]
pub struct GridPoint {
    /// Rows of the device-resident input.
    pub n: usize,
    pub k: usize,
    pub kind: KeyWidth,
    /// The key type's name (`f32`, `i64`, …): types of one kind are different inputs (at n = 2^20
    /// f64 zipf ties take over twice as long as i64 ones), so different cases.
    pub key: String,
    /// The distribution's name, for reports.
    pub dist: String,
    /// The filter's selectivity (1: no filter, the selection reads the positional keys).
    pub sel: f64,
    /// Rows the filter kept (n when sel is 1).
    pub kept: usize,
    /// The tie share the model is told ([`Case::ties`]).
    pub ties: f64,
    pub algorithm: DeviceAlgorithm,
    pub measured_s: f64,
}

impl GridPoint {
    /// The model's prediction: the filter pass (below selectivity 1), then the selection.
    pub fn predict(&self, model: &CostModel) -> Option<f64> {
        let (case, filter) = if self.sel < 1.0 {
            (
                Case::pairs(self.kept, self.k, self.kind, self.n),
                model.filter_time(self.n, self.kept, self.kind),
            )
        } else {
            (Case::positional(self.n, self.k, self.kind), 0.0)
        };
        let case = Case {
            ties: self.ties,
            ..case
        };
        model.predict(self.algorithm, &case).map(|t| t + filter)
    }

    fn same_case(&self, other: &GridPoint) -> bool {
        (self.n, self.k, &self.key, &self.dist) == (other.n, other.k, &other.key, &other.dist)
            && self.sel == other.sel
    }

    fn describe(&self) -> String {
        format!(
            "n={} k={} {} {} sel={}",
            self.n, self.k, self.key, self.dist, self.sel
        )
    }
}

/// The model's record over a grid.
#[derive(Debug, Clone, PartialEq)]
pub struct Assessment {
    /// Cases (points with the same n, k, key type, distribution and selectivity) with more than
    /// one algorithm measured, and those where the predicted-fastest algorithm's measured time
    /// is within 10% of the fastest measured.
    pub cases: usize,
    pub within_10: usize,
    /// The largest (chosen / fastest − 1), and that case's description.
    pub worst_regret: f64,
    pub worst: String,
    /// The cases off by more than 10%, described.
    pub misses: Vec<String>,
    /// Median |predicted − measured| / measured over every point, and over the chosen ones.
    pub median_error: f64,
    pub median_chosen_error: f64,
    pub points: usize,
}

impl Assessment {
    pub fn within_share(&self) -> f64 {
        self.within_10 as f64 / self.cases.max(1) as f64
    }
}

/// Assesses `predicted[i]` (seconds; `None`: the model declines that algorithm) against
/// `points[i]`.
pub fn assess(points: &[GridPoint], predicted: &[Option<f64>]) -> Assessment {
    let mut cases: Vec<Vec<usize>> = Vec::new();
    for (i, p) in points.iter().enumerate() {
        match cases.iter_mut().find(|c| points[c[0]].same_case(p)) {
            Some(c) => c.push(i),
            None => cases.push(vec![i]),
        }
    }
    let mut a = Assessment {
        cases: 0,
        within_10: 0,
        worst_regret: 0.0,
        worst: String::new(),
        misses: Vec::new(),
        median_error: f64::NAN,
        median_chosen_error: f64::NAN,
        points: 0,
    };
    let mut errors = Vec::new();
    let mut chosen_errors = Vec::new();
    for case in cases.iter().filter(|c| c.len() > 1) {
        let best = case
            .iter()
            .copied()
            .min_by(|&x, &y| points[x].measured_s.total_cmp(&points[y].measured_s));
        let chosen = case
            .iter()
            .copied()
            .filter(|&i| predicted[i].is_some())
            .min_by(|&x, &y| predicted[x].unwrap().total_cmp(&predicted[y].unwrap()));
        let (Some(best), Some(chosen)) = (best, chosen) else {
            continue;
        };
        let regret = points[chosen].measured_s / points[best].measured_s - 1.0;
        a.cases += 1;
        let what = format!(
            "{}: chose {} {:.3} ms, fastest {} {:.3} ms",
            points[chosen].describe(),
            points[chosen].algorithm.name(),
            points[chosen].measured_s * 1e3,
            points[best].algorithm.name(),
            points[best].measured_s * 1e3
        );
        if regret <= 0.10 {
            a.within_10 += 1;
        } else {
            a.misses
                .push(format!("off by {:.0}%: {what}", 100.0 * regret));
        }
        if a.worst.is_empty() || regret > a.worst_regret {
            a.worst_regret = regret;
            a.worst = what;
        }
        for &i in case {
            if let Some(p) = predicted[i] {
                let e = (p - points[i].measured_s).abs() / points[i].measured_s;
                errors.push(e);
                if i == chosen {
                    chosen_errors.push(e);
                }
            }
        }
    }
    a.points = errors.len();
    a.median_error = median(&mut errors);
    a.median_chosen_error = median(&mut chosen_errors);
    a
}

/// The measured points of a kernel-benchmark CSV (its rows marked `ok`). Filtered rows keep
/// sel × n rows (the hash filter's expectation); a CSV without a `ties` column tells the model
/// none.
pub fn parse_grid_csv(text: &str) -> Result<Vec<GridPoint>, String> {
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().ok_or("empty CSV")?.split(',').collect();
    let column = |name: &str| {
        header
            .iter()
            .position(|h| *h == name)
            .ok_or_else(|| format!("no column {name}"))
    };
    let [n, k, key, dist, algo, measured, ok] =
        ["n", "k", "key", "dist", "algo", "median_ms", "ok"].map(column);
    let (sel, ties) = (column("sel").ok(), column("ties").ok());
    let mut points = Vec::new();
    for line in lines.filter(|l| !l.trim().is_empty()) {
        let f: Vec<&str> = line.split(',').collect();
        let get = |c: &Result<usize, String>| -> Result<&str, String> {
            let c = c.as_ref().map_err(Clone::clone)?;
            f.get(*c)
                .copied()
                .ok_or_else(|| format!("short line: {line}"))
        };
        let num = |v: &str| v.parse::<f64>().map_err(|e| format!("{line}: {e}"));
        if get(&ok)? != "ok" {
            continue;
        }
        let kind = match get(&key)? {
            "f32" | "i32" => KeyWidth::W32,
            "f64" | "i64" => KeyWidth::W64,
            other => return Err(format!("{line}: unknown key type {other}")),
        };
        let algorithm = DeviceAlgorithm::ALL
            .into_iter()
            .find(|a| a.name() == get(&algo).unwrap_or(""))
            .ok_or_else(|| format!("{line}: unknown algorithm"))?;
        let rows = num(get(&n)?)? as usize;
        let sel = match sel.and_then(|c| f.get(c)) {
            Some(v) => num(v)?,
            None => 1.0,
        };
        points.push(GridPoint {
            n: rows,
            k: num(get(&k)?)? as usize,
            kind,
            key: get(&key)?.to_string(),
            dist: get(&dist)?.to_string(),
            sel,
            kept: if sel < 1.0 {
                ((rows as f64 * sel) as usize).max(1)
            } else {
                rows
            },
            ties: ties
                .and_then(|c| f.get(c))
                .and_then(|v| v.parse().ok())
                .unwrap_or(0.0),
            algorithm,
            measured_s: num(get(&measured)?)? / 1e3,
        });
    }
    Ok(points)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(n: usize, algorithm: DeviceAlgorithm, ms: f64) -> GridPoint {
        GridPoint {
            n,
            k: 32,
            kind: KeyWidth::W32,
            key: "i32".into(),
            dist: "uniform".into(),
            sel: 1.0,
            kept: n,
            ties: 0.0,
            algorithm,
            measured_s: ms / 1e3,
        }
    }

    #[test]
    fn choices_regrets_and_errors_are_counted_per_case() {
        use DeviceAlgorithm::{Radix, Sample};
        let points = [
            point(1 << 20, Sample, 1.0),
            point(1 << 20, Radix, 2.0),
            point(1 << 24, Sample, 1.0),
            point(1 << 24, Radix, 1.5),
            // Alone in its case: not a choice.
            point(1 << 28, Sample, 1.0),
        ];
        // Right on the first case (exact), wrong on the second (radix predicted faster).
        let predicted = [
            Some(1.0e-3),
            Some(2.0e-3),
            Some(2.0e-3),
            Some(1.2e-3),
            Some(5.0e-3),
        ];
        let a = assess(&points, &predicted);
        assert_eq!((a.cases, a.within_10), (2, 1));
        assert!((a.worst_regret - 0.5).abs() < 1e-12, "{a:?}");
        assert!(a.worst.contains("chose radix"), "{}", a.worst);
        assert_eq!(a.misses.len(), 1);
        // Errors 0, 0, 1, 0.2 over the four points in cases: median 0.1.
        assert_eq!(a.points, 4);
        assert!((a.median_error - 0.1).abs() < 1e-12, "{a:?}");
    }

    #[test]
    fn key_types_of_one_kind_are_separate_cases() {
        use DeviceAlgorithm::{Radix, Sample};
        let typed = |key: &str, algorithm, ms| GridPoint {
            kind: KeyWidth::W64,
            key: key.into(),
            ..point(1 << 20, algorithm, ms)
        };
        // f64: sample (chosen) 2 ms, radix 3 ms; i64: sample 1 ms, radix 4 ms. Pooled, f64's
        // choice would be measured against i64's 1 ms.
        let points = [
            typed("f64", Sample, 2.0),
            typed("f64", Radix, 3.0),
            typed("i64", Sample, 1.0),
            typed("i64", Radix, 4.0),
        ];
        let predicted = [Some(1e-3), Some(2e-3), Some(1e-3), Some(2e-3)];
        let a = assess(&points, &predicted);
        assert_eq!((a.cases, a.within_10), (2, 2), "{a:?}");
        assert_eq!(a.worst_regret, 0.0);
    }

    #[test]
    fn the_grid_csv_parses_and_rejects_bad_rows() {
        let text = "n,k,key,dist,algo,reps,median_ms,min_ms,max_ms,floor_ms,x_floor,floor_gbps,ok,sel,predicted_ms,ties\n\
                    65536,32,i32,uniform,sample,5,0.025,0.02,0.03,0.004,6,60,ok,1,0.03,0\n\
                    65536,32,i64,zipf-ties,radix,5,0.1,0.1,0.1,0.004,6,60,ok,0.1,,0.25\n\
                    65536,32,i32,uniform,radix,5,nan,nan,nan,0.004,nan,60,n/a,1,,0\n";
        let points = parse_grid_csv(text).unwrap();
        assert_eq!(points.len(), 2);
        assert_eq!(points[1].kind, KeyWidth::W64);
        assert_eq!(points[1].key, "i64");
        assert_eq!(points[1].kept, 6553);
        assert_eq!(points[1].ties, 0.25);
        assert!(parse_grid_csv("n,k\n1,2\n").is_err());
        let bad = text.replace("sample", "quicksort");
        assert!(parse_grid_csv(&bad).is_err());
    }
}
