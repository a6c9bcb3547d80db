//! Prompt text for workloads: a real public-domain text (the opening chapters' prose of Jane
//! Austen's "Pride and Prejudice", 1813), so prompts tokenize like real input rather than like
//! repeated filler, and every run's prompts are the same bytes.

/// The source text.
pub const PRIDE_AND_PREJUDICE: &str = "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a wife. However little known the feelings or views of such a man may be on his first entering a neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he is considered the rightful property of some one or other of their daughters. \"My dear Mr. Bennet,\" said his lady to him one day, \"have you heard that Netherfield Park is let at last?\" Mr. Bennet replied that he had not. \"But it is,\" returned she; \"for Mrs. Long has just been here, and she told me all about it.\" Mr. Bennet made no answer. \"Do you not want to know who has taken it?\" cried his wife impatiently. \"You want to tell me, and I have no objection to hearing it.\" This was invitation enough. \"Why, my dear, you must know, Mrs. Long says that Netherfield is taken by a young man of large fortune from the north of England; that he came down on Monday in a chaise and four to see the place, and was so much delighted with it, that he agreed with Mr. Morris immediately; that he is to take possession before Michaelmas, and some of his servants are to be in the house by the end of next week.\" \"What is his name?\" \"Bingley.\" \"Is he married or single?\" \"Oh! Single, my dear, to be sure! A single man of large fortune; four or five thousand a year. What a fine thing for our girls!\" \"How so? How can it affect them?\" \"My dear Mr. Bennet,\" replied his wife, \"how can you be so tiresome! You must know that I am thinking of his marrying one of them.\" \"Is that his design in settling here?\" \"Design! Nonsense, how can you talk so! But it is very likely that he may fall in love with one of them, and therefore you must visit him as soon as he comes.\" \"I see no occasion for that. You and the girls may go, or you may send them by themselves, which perhaps will be still better, for as you are as handsome as any of them, Mr. Bingley may like you the best of the party.\" \"My dear, you flatter me. I certainly have had my share of beauty, but I do not pretend to be anything extraordinary now. When a woman has five grown-up daughters, she ought to give over thinking of her own beauty.\"";

/// Roughly `approx_tokens` tokens of the text (≈ 0.75 words per token for English BPE), starting
/// at word `offset` and wrapping around, so prompts of one request differ from the next.
pub fn prose(approx_tokens: usize, offset: usize) -> String {
    // Split once: a million simulated requests make two texts each.
    static WORDS: std::sync::LazyLock<Vec<&'static str>> =
        std::sync::LazyLock::new(|| PRIDE_AND_PREJUDICE.split_whitespace().collect());
    let words = &*WORDS;
    let n_words = (approx_tokens * 3).div_ceil(4).max(1);
    (0..n_words).map(|i| words[(offset + i) % words.len()]).collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prose_wraps_and_scales() {
        let short = prose(4, 0);
        assert_eq!(short, "It is a");
        let long = prose(4000, 17);
        assert!(long.split_whitespace().count() == 3000);
        assert_ne!(prose(10, 0), prose(10, 1));
    }
}
