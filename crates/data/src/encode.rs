//! Encoding a document of any length ([`encode_long`]): in pieces cut between words, so memory
//! stays bounded and the ids are the whole text's for the byte-level, Metaspace and
//! SentencePiece-legacy tokenizers of the hub.

use tokenizers::Tokenizer;

/// Longest piece of a document encoded at once: the tokenizer's intermediate structures take
/// about a hundred times the text's bytes, so a document of hundreds of megabytes is encoded a
/// piece at a time in bounded memory.
pub const ENCODE_PIECE_BYTES: usize = 1 << 20;

/// The pieces [`encode_long`] encodes `text` in: at most `max` bytes each (a character longer
/// than that stays whole), cut just before a space that follows a non-space character (`"a b"`
/// into `"a"` and `" b"`) where there is one. That is a boundary of every pre-token of the
/// byte-level (GPT-2 style) and Metaspace (SentencePiece style) pre-tokenizers, so the pieces'
/// ids are the whole text's. A piece without such a space is cut after its last letter followed
/// by punctuation (a byte-level word boundary, [`word_end`]), else at a character boundary,
/// which [`encode_long`] refuses: there the pieces' ids could differ from the whole text's.
pub fn encode_pieces(text: &str, max: usize) -> Vec<&str> {
    cuts(text, max)
        .into_iter()
        .map(|(piece, _)| piece)
        .collect()
}

/// [`encode_pieces`] with, for each piece, whether it ends at a boundary of every pre-token
/// (a space after a non-space, a letter before punctuation, or the text's end) rather than at a
/// bare character boundary inside a run that has neither.
fn cuts(text: &str, max: usize) -> Vec<(&str, bool)> {
    let max = max.max(1);
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    let mut start = 0;
    while text.len() - start > max {
        let mut end = start + max;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        let cut = (start + 1..=end)
            .rev()
            .find(|&p| bytes[p] == b' ' && !bytes[p - 1].is_ascii_whitespace())
            .or_else(|| word_end(&text[start..end]).map(|p| start + p));
        let (end, safe) = match cut {
            Some(p) => (p, true),
            None if end > start => (end, false),
            None => {
                // One character longer than `max`: keep it whole.
                let mut e = start + 1;
                while !text.is_char_boundary(e) {
                    e += 1;
                }
                (e, false)
            }
        };
        out.push((&text[start..end], safe));
        start = end;
    }
    if start < text.len() || out.is_empty() {
        out.push((&text[start..], true));
    }
    out
}

/// The last place in `text` (after its first character) where a letter is followed by a
/// character that is neither a letter, a digit nor whitespace (`abc|(`): a boundary of the
/// byte-level pre-tokenizers' words in text without spaces (CJK, code, base64).
fn word_end(text: &str) -> Option<usize> {
    let mut next: Option<char> = None;
    for (p, c) in text.char_indices().rev() {
        if let Some(n) = next {
            if c.is_alphabetic() && !n.is_alphanumeric() && !n.is_whitespace() {
                return Some(p + c.len_utf8());
            }
        }
        next = Some(c);
    }
    None
}

/// The ids of `text` without special tokens, encoded in pieces of at most
/// [`ENCODE_PIECE_BYTES`] ([`encode_pieces`]) so memory stays bounded for any length.
pub fn encode_long(tokenizer: &Tokenizer, text: &str) -> tokenizers::Result<Vec<u32>> {
    encode_in_pieces(tokenizer, text, ENCODE_PIECE_BYTES)
}

/// [`encode_long`] with pieces of at most `max` bytes.
fn encode_in_pieces(tokenizer: &Tokenizer, text: &str, max: usize) -> tokenizers::Result<Vec<u32>> {
    let cuts = cuts(text, max);
    // A cut inside a run without any word boundary could change the ids around it: refused
    // rather than encoded differently from the whole text.
    let mut at = 0;
    for (piece, safe) in &cuts {
        if !safe {
            return Err(format!(
                "bytes {at}..{} of the document hold no space and no letter followed by \
                 punctuation, so no cut into pieces of at most {max} bytes keeps the whole \
                 text's ids; split the document there",
                at + piece.len()
            )
            .into());
        }
        at += piece.len();
    }
    let pieces: Vec<&str> = cuts.into_iter().map(|(piece, _)| piece).collect();
    let drop_space = pieces.len() > 1 && marks_every_input(tokenizer)?;
    let mut ids = Vec::new();
    for (i, piece) in pieces.into_iter().enumerate() {
        // The marker the tokenizer puts before every input stands for the space cut at.
        let piece = match (i, drop_space) {
            (1.., true) => piece.strip_prefix(' ').unwrap_or(piece),
            _ => piece,
        };
        ids.extend_from_slice(tokenizer.encode_fast(piece, false)?.get_ids());
    }
    Ok(ids)
}

/// Whether `tokenizer` puts a word-start marker before every input (SentencePiece's legacy
/// layout on the hub, Llama 2's and Mistral's: a `Prepend("▁")` normalizer): then a piece that
/// starts with a space must be encoded without it, or that space is encoded twice. Told from
/// its encodings: `"hello world"` is `"hello"` then `" world"` for the byte-level and Metaspace
/// pre-tokenizers, and `"hello"` then `"world"` for such a tokenizer.
fn marks_every_input(tokenizer: &Tokenizer) -> tokenizers::Result<bool> {
    let ids = |t: &str| -> tokenizers::Result<Vec<u32>> {
        Ok(tokenizer.encode_fast(t, false)?.get_ids().to_vec())
    };
    let whole = ids("hello world")?;
    let head = ids("hello")?;
    if [head.clone(), ids(" world")?].concat() == whole {
        return Ok(false);
    }
    Ok([head, ids("world")?].concat() == whole)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::load_tokenizer;

    /// Long documents are encoded in pieces whose ids are the whole text's (the pieces
    /// end before a space that follows a non-space), each at most the limit.
    #[test]
    fn pieces_encode_to_the_whole_texts_ids() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../data/shakespeare/tokenizer.json"
        );
        let tok = load_tokenizer(path).unwrap();
        let play = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../data/shakespeare/macbeth_gut.txt"
        );
        let text = std::fs::read_to_string(play).unwrap();
        let whole = tok
            .encode_fast(text.as_str(), false)
            .unwrap()
            .get_ids()
            .to_vec();
        for max in [64, 1000, 4096] {
            let pieces = encode_pieces(&text, max);
            assert_eq!(pieces.concat(), text);
            assert!(pieces.iter().all(|p| p.len() <= max), "max {max}");
            let mut ids = Vec::new();
            for p in &pieces {
                ids.extend_from_slice(tok.encode_fast(*p, false).unwrap().get_ids());
            }
            assert_eq!(ids, whole, "pieces of at most {max} bytes");
        }
        assert_eq!(encode_long(&tok, &text).unwrap(), whole);
        // Without spaces, and with characters wider than the limit.
        assert_eq!(encode_pieces("abcdef", 4), ["abcd", "ef"]);
        assert_eq!(encode_pieces("ééé", 1), ["é", "é", "é"]);
        assert_eq!(encode_pieces("", 4), [""]);
        // Never between two spaces: a run of spaces stays with the word before it.
        assert_eq!(encode_pieces("ab  cd ef", 5), ["ab", "  cd", " ef"]);
        // Without spaces, after a letter followed by punctuation (not after a digit).
        assert_eq!(encode_pieces("abc(def", 5), ["abc", "(def"]);
        assert_eq!(encode_pieces("12(45678", 5), ["12(45", "678"]);
        assert_eq!(encode_pieces("漢字。漢字", 9), ["漢字", "。漢字"]);
        // The play without spaces: cut at word ends, its ids are still the whole text's.
        let packed = text.replace([' ', '\n'], "");
        let whole = tok.encode_fast(packed.as_str(), false).unwrap();
        let pieces = encode_in_pieces(&tok, &packed, 4096).unwrap();
        assert_eq!(pieces, whole.get_ids());
    }

    /// A tokenizer of SentencePiece's legacy hub layout (Llama 2, Mistral): a `Prepend("▁")`
    /// and `Replace(" ", "▁")` normalizer, no pre-tokenizer, here with a vocabulary of single
    /// characters.
    fn legacy_sentencepiece(text: &str) -> Tokenizer {
        let mut chars: Vec<char> = text.chars().chain(['▁']).collect();
        chars.sort_unstable();
        chars.dedup();
        let vocab: serde_json::Map<String, serde_json::Value> = (0..)
            .zip(chars)
            .map(|(i, c)| (c.to_string(), i.into()))
            .collect();
        let json = serde_json::json!({
            "version": "1.0",
            "added_tokens": [],
            "normalizer": {"type": "Sequence", "normalizers": [
                {"type": "Prepend", "prepend": "▁"},
                {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
            ]},
            "pre_tokenizer": null,
            "post_processor": null,
            "decoder": null,
            "model": {"type": "BPE", "vocab": vocab, "merges": []},
        });
        Tokenizer::from_bytes(json.to_string().as_bytes()).unwrap()
    }

    /// Pieces of a tokenizer that marks every input start are encoded without the space they
    /// were cut before: the ids equal the whole text's.
    #[test]
    fn pieces_of_a_legacy_sentencepiece_tokenizer_encode_to_the_whole_texts_ids() {
        let text = "the king hath happily received, macbeth, the news of thy success ".repeat(40);
        let tok = legacy_sentencepiece(&text);
        assert!(marks_every_input(&tok).unwrap());
        let whole = tok.encode_fast(text.as_str(), false).unwrap();
        for max in [16, 100, 1000] {
            assert_eq!(
                encode_in_pieces(&tok, &text, max).unwrap(),
                whole.get_ids(),
                "pieces of at most {max} bytes"
            );
        }
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../data/shakespeare/tokenizer.json"
        );
        assert!(!marks_every_input(&load_tokenizer(path).unwrap()).unwrap());
    }
}
