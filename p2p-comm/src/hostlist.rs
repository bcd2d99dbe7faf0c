//! Slurm's compressed host lists (`node[01-04,07],gpu-a[1-2]`), expanded to host names.
//!
//! Slurm hands each task its node list in this form (`SLURM_STEP_NODELIST`, `SLURM_JOB_NODELIST`); the bootstrap
//! takes the first host as rank 0's when `MASTER_ADDR` is not set. The grammar is Slurm's `hostlist.c`: entries
//! separated by commas outside brackets; an entry is text with bracket groups of comma-separated numbers and
//! `lo-hi` ranges; a group's numbers are zero-padded to the width of the range's low bound as written
//! (`[08-10]` gives `08 09 10`, `[8-10]` gives `8 9 10`); several groups in one entry multiply out, the last one
//! varying fastest.

/// The most hosts an expansion may produce: a list that expands past this is refused rather than allocated.
pub(crate) const MAX_HOSTS: usize = 1 << 20;

/// Expands a Slurm host list into its host names, in Slurm's order.
pub(crate) fn expand_hostlist(list: &str) -> Result<Vec<String>, String> {
    let mut hosts = Vec::new();
    for entry in split_outside_brackets(list)? {
        if entry.is_empty() {
            continue; // `a,,b` and a trailing comma: Slurm skips empty entries too
        }
        expand_entry(entry, &mut hosts)?;
    }
    if hosts.is_empty() {
        return Err(format!("host list {list:?} names no host"));
    }
    Ok(hosts)
}

/// Splits at commas that are not inside a bracket group, checking that brackets balance and do not nest.
fn split_outside_brackets(list: &str) -> Result<Vec<&str>, String> {
    let mut parts = Vec::new();
    let (mut open, mut start) = (false, 0);
    for (i, c) in list.char_indices() {
        match c {
            '[' if open => return Err(format!("host list {list:?}: nested '[' at byte {i}")),
            '[' => open = true,
            ']' if !open => return Err(format!("host list {list:?}: ']' without '[' at byte {i}")),
            ']' => open = false,
            ',' if !open => {
                parts.push(list[start..i].trim());
                start = i + 1;
            }
            _ => {}
        }
    }
    if open {
        return Err(format!("host list {list:?}: '[' is never closed"));
    }
    parts.push(list[start..].trim());
    Ok(parts)
}

/// One piece of an entry: literal text, or the numbers of a bracket group already formatted.
enum Piece<'a> {
    Text(&'a str),
    Group(Vec<String>),
}

fn expand_entry(entry: &str, hosts: &mut Vec<String>) -> Result<(), String> {
    let mut pieces = Vec::new();
    let mut rest = entry;
    let mut count: usize = 1;
    while let Some(open) = rest.find('[') {
        // Brackets balance (checked by the split), so a ']' follows.
        let close = open + rest[open..].find(']').ok_or_else(|| format!("host {entry:?}: '[' is never closed"))?;
        pieces.push(Piece::Text(&rest[..open]));
        let group = expand_group(&rest[open + 1..close]).map_err(|e| format!("host {entry:?}: {e}"))?;
        count = count.saturating_mul(group.len());
        if hosts.len().saturating_add(count) > MAX_HOSTS {
            return Err(format!("host list expands to more than {MAX_HOSTS} hosts"));
        }
        pieces.push(Piece::Group(group));
        rest = &rest[close + 1..];
    }
    pieces.push(Piece::Text(rest));
    if pieces.iter().all(|p| matches!(p, Piece::Text(t) if t.is_empty())) {
        return Err(format!("host {entry:?} is empty"));
    }
    // Odometer over the groups, the last one fastest.
    let groups: Vec<usize> =
        pieces.iter().enumerate().filter_map(|(i, p)| matches!(p, Piece::Group(_)).then_some(i)).collect();
    let mut at = vec![0usize; pieces.len()];
    loop {
        let mut name = String::new();
        for (p, &k) in pieces.iter().zip(&at) {
            match p {
                Piece::Text(t) => name.push_str(t),
                Piece::Group(g) => name.push_str(&g[k]),
            }
        }
        hosts.push(name);
        let mut carried = true;
        for &g in groups.iter().rev() {
            let Piece::Group(values) = &pieces[g] else { unreachable!("groups index group pieces") };
            at[g] += 1;
            if at[g] < values.len() {
                carried = false;
                break;
            }
            at[g] = 0;
        }
        if carried {
            return Ok(());
        }
    }
}

/// `01-03,7` → `01 02 03 7`.
fn expand_group(group: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    for range in group.split(',') {
        let range = range.trim();
        let (lo, hi) = range.split_once('-').unwrap_or((range, range));
        let number = |s: &str| -> Result<u64, String> {
            if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
                return Err(format!("{range:?} in [{group}] is not a number or a lo-hi range"));
            }
            s.parse::<u64>().map_err(|_| format!("{s:?} in [{group}] is too large"))
        };
        let (a, b) = (number(lo)?, number(hi)?);
        if b < a {
            return Err(format!("range {range:?} in [{group}] runs backwards"));
        }
        if (b - a) as usize >= MAX_HOSTS - out.len().min(MAX_HOSTS) {
            return Err(format!("host list expands to more than {MAX_HOSTS} hosts"));
        }
        let width = lo.len();
        out.extend((a..=b).map(|n| format!("{n:0width$}")));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn expands_slurm_examples() {
        let e = |s: &str| expand_hostlist(s).unwrap();
        assert_eq!(e("node01"), ["node01"]);
        assert_eq!(e("node[01-03,07]"), ["node01", "node02", "node03", "node07"]);
        assert_eq!(e("n[8-10]"), ["n8", "n9", "n10"]);
        assert_eq!(e("n[08-10]"), ["n08", "n09", "n10"]);
        assert_eq!(e("a[1-2],b,c[3]"), ["a1", "a2", "b", "c3"]);
        assert_eq!(e("r[1-2]-n[0-1].x"), ["r1-n0.x", "r1-n1.x", "r2-n0.x", "r2-n1.x"]);
        assert_eq!(e("10.0.0.[1-2]"), ["10.0.0.1", "10.0.0.2"]);
        assert_eq!(e(" a , b ,"), ["a", "b"]);
    }

    #[test]
    fn refuses_malformed_lists() {
        for bad in ["", ",", "n[1-", "n]1", "n[[1]]", "n[3-1]", "n[]", "n[a]", "n[1-2-3]", "n[1:2]", "[1-2000000]"] {
            assert!(expand_hostlist(bad).is_err(), "{bad:?} was accepted");
        }
        assert!(expand_hostlist("a[1-2000]b[1-2000]").unwrap_err().contains("more than"));
    }

    /// A host list drawn as structure: entries of (text, group) parts, each group a list of (lo, hi, width).
    type Group = Vec<(u64, u64, usize)>;
    type Entry = (Vec<(String, Group)>, String);

    fn entry() -> impl Strategy<Value = Entry> {
        let range = (0u64..200, 0u64..4, 1usize..4).prop_map(|(lo, len, w)| (lo, lo + len, w));
        let part = ("[a-z.-]{0,3}", proptest::collection::vec(range, 1..4));
        (proptest::collection::vec(part, 0..3), "[a-z]{1,3}")
    }

    /// The reference: format the drawn structure directly, in nested loops.
    fn names(e: &Entry) -> Vec<String> {
        let mut names = vec![String::new()];
        for (text, group) in &e.0 {
            let values: Vec<String> =
                group.iter().flat_map(|&(lo, hi, w)| (lo..=hi).map(move |n| format!("{n:0w$}"))).collect();
            names = names.iter().flat_map(|p| values.iter().map(move |v| format!("{p}{text}{v}"))).collect();
        }
        names.into_iter().map(|n| n + &e.1).collect()
    }

    fn render(e: &Entry) -> String {
        let mut s = String::new();
        for (text, group) in &e.0 {
            let ranges: Vec<String> = group
                .iter()
                .map(|&(lo, hi, w)| if lo == hi { format!("{lo:0w$}") } else { format!("{lo:0w$}-{hi:0w$}") })
                .collect();
            s += &format!("{text}[{}]", ranges.join(","));
        }
        s + &e.1
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        #[test]
        fn expansion_matches_the_structure(entries in proptest::collection::vec(entry(), 1..4)) {
            // The width comes from the low bound as written, which `render` pads to `w`; a number at or above
            // the low bound never has fewer digits than it, so padding to `w` in `names` agrees.
            let list = entries.iter().map(render).collect::<Vec<_>>().join(",");
            let want: Vec<String> = entries.iter().flat_map(names).collect();
            prop_assert_eq!(expand_hostlist(&list).unwrap(), want, "list {}", list);
        }
    }
}
