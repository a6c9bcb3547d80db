//! Byte-pair merging of one pre-tokenized, byte-encoded word, by merge rank.
//!
//! Same algorithm and tie-breaking as llama.cpp's `llm_tokenizer_bpe_session::tokenize`: the
//! word starts as one symbol per (byte-encoded) character in a doubly linked list; every
//! adjacent pair that has a merge rank goes into a min-heap keyed by (rank, left index); the
//! best pair is merged in place and its two new neighbour pairs are pushed. Stale heap entries
//! are recognised by the symbol lengths recorded at push time (llama.cpp compares the joined
//! text; since a symbol only ever grows at a fixed start, equal lengths ⇔ equal text). This
//! is O(n log n) per word with no string rebuilding; the tokenizer adds a per-word cache.
//!
//! Merge ranks are keyed by the GGUF merge line itself (`"left right"`): byte-level encoding
//! maps the space byte to `Ġ`, so a symbol never contains a raw space and `left + ' ' + right`
//! is an unambiguous key, with no per-merge tuple of strings to allocate.

use ahash::AHashMap as HashMap;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::ops::Range;

/// Merge ranks from `tokenizer.ggml.merges` (line index = rank; first occurrence wins).
#[derive(Debug, Default)]
pub(crate) struct MergeRanks {
    ranks: HashMap<Box<str>, u32>,
}

impl MergeRanks {
    pub fn new(merges: &[String]) -> Self {
        let mut ranks = HashMap::with_capacity(merges.len());
        for (i, line) in merges.iter().enumerate() {
            // llama.cpp splits at the first space at index >= 1; a line without one becomes
            // the pair ("", ""), which no symbol pair can ever match, so we just skip it.
            // (Byte index 1, not char index: search the bytes; a space is always a boundary.)
            let Some(sp) = line.bytes().skip(1).position(|b| b == b' ').map(|p| p + 1) else { continue };
            let key: Box<str> = format!("{} {}", &line[..sp], &line[sp + 1..]).into();
            ranks.entry(key).or_insert(i as u32);
        }
        Self { ranks }
    }

    pub fn len(&self) -> usize {
        self.ranks.len()
    }

    fn rank(&self, buf: &mut String, left: &str, right: &str) -> Option<u32> {
        buf.clear();
        buf.push_str(left);
        buf.push(' ');
        buf.push_str(right);
        self.ranks.get(buf.as_str()).copied()
    }

    /// Merges `word` (already byte-encoded) and appends the final symbols, as byte ranges of
    /// `word`, to `out`.
    pub fn merge(&self, word: &str, out: &mut Vec<Range<usize>>) {
        let mut syms: Vec<Sym> = Vec::with_capacity(word.len());
        for (i, (start, c)) in word.char_indices().enumerate() {
            syms.push(Sym { start, len: c.len_utf8(), prev: i.checked_sub(1), next: Some(i + 1) });
        }
        if let Some(last) = syms.last_mut() {
            last.next = None;
        }
        let mut heap = BinaryHeap::new();
        let mut buf = String::new();
        let mut push =
            |syms: &[Sym], heap: &mut BinaryHeap<Reverse<Pair>>, l: Option<usize>, r: Option<usize>| {
                let (Some(l), Some(r)) = (l, r) else { return };
                let (ls, rs) = (&syms[l], &syms[r]);
                let left = &word[ls.start..ls.start + ls.len];
                let right = &word[rs.start..rs.start + rs.len];
                if let Some(rank) = self.rank(&mut buf, left, right) {
                    heap.push(Reverse(Pair { rank, left: l, right: r, left_len: ls.len, right_len: rs.len }));
                }
            };
        for i in 1..syms.len() {
            push(&syms, &mut heap, Some(i - 1), Some(i));
        }
        while let Some(Reverse(p)) = heap.pop() {
            let (ll, rl) = (syms[p.left].len, syms[p.right].len);
            if ll == 0 || rl == 0 || ll != p.left_len || rl != p.right_len {
                continue; // outdated
            }
            let right_next = syms[p.right].next;
            syms[p.left].len += rl;
            syms[p.right].len = 0;
            syms[p.left].next = right_next;
            if let Some(n) = right_next {
                syms[n].prev = Some(p.left);
            }
            let prev = syms[p.left].prev;
            push(&syms, &mut heap, prev, Some(p.left));
            push(&syms, &mut heap, Some(p.left), right_next);
        }
        out.extend(syms.iter().filter(|s| s.len > 0).map(|s| s.start..s.start + s.len));
    }
}

#[derive(Debug, Clone, Copy)]
struct Sym {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

/// A candidate merge; ordered by (rank, left index) like llama.cpp's comparator, the other
/// fields only break ties between a live entry and stale copies of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Pair {
    rank: u32,
    left: usize,
    right: usize,
    left_len: usize,
    right_len: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn merged(ranks: &MergeRanks, word: &str) -> Vec<String> {
        let mut out = Vec::new();
        ranks.merge(word, &mut out);
        out.into_iter().map(|r| word[r].to_string()).collect()
    }

    #[test]
    fn merges_by_rank_not_position() {
        let ranks = MergeRanks::new(&["b c".into(), "a b".into(), "a bc".into()]);
        assert_eq!(merged(&ranks, "abc"), ["abc"]);
        let ranks = MergeRanks::new(&["a b".into(), "b c".into()]);
        assert_eq!(merged(&ranks, "abc"), ["ab", "c"]);
        assert_eq!(merged(&ranks, "abab"), ["ab", "ab"]);
    }

    #[test]
    fn equal_ranks_merge_leftmost_first() {
        let ranks = MergeRanks::new(&["a a".into()]);
        assert_eq!(merged(&ranks, "aaa"), ["aa", "a"]);
        assert_eq!(merged(&ranks, ""), Vec::<String>::new());
    }

    #[test]
    fn first_duplicate_merge_wins_and_bad_lines_are_ignored() {
        let ranks = MergeRanks::new(&["x".into(), "a b".into(), "a b".into(), "Ġ t".into()]);
        assert_eq!(ranks.len(), 2);
        assert_eq!(merged(&ranks, "ab"), ["ab"]);
        assert_eq!(merged(&ranks, "Ġt"), ["Ġt"]); // multi-byte first symbol
    }
}
