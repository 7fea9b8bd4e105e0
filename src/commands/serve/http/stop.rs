//! Stop strings (`"stop"`): generation ends where the text first contains
//! one, and the stop string itself is not sent.
//!
//! Text is streamed piece by piece, so the end of what came so far may be
//! the start of a stop string: that much is held back until the next piece
//! shows whether it completes one.
//!
//! ```text
//!  stop = ["\n\nUser:"]     pieces: "Hi." "\n" "\nUser:" …
//!  push("Hi.")      → emit "Hi."       hold ""
//!  push("\n")       → emit ""          hold "\n"        (could start the stop)
//!  push("\nUser:")  → emit "" , stop   (held + piece contains the stop string)
//! ```

/// Most stop strings a request may give (OpenAI's limit).
pub const MAX_STOP_STRINGS: usize = 4;

/// The stop strings of one request, and the text held back so far.
#[derive(Debug, Default)]
pub struct StopStrings {
    stops: Vec<String>,
    held: String,
}

/// What one piece of text gives the client.
#[derive(Debug, PartialEq, Eq)]
pub struct Pushed {
    /// Text to send now.
    pub emit: String,
    /// Whether a stop string was reached: nothing more is sent.
    pub stopped: bool,
}

impl StopStrings {
    /// Watches for `stops` (none: every piece passes straight through).
    pub fn new(stops: Vec<String>) -> StopStrings {
        StopStrings {
            stops,
            held: String::new(),
        }
    }

    /// Takes the next piece of generated text.
    pub fn push(&mut self, piece: &str) -> Pushed {
        if self.stops.is_empty() {
            return Pushed {
                emit: piece.to_string(),
                stopped: false,
            };
        }
        self.held.push_str(piece);
        let first = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min();
        if let Some(at) = first {
            self.held.truncate(at);
            return Pushed {
                emit: std::mem::take(&mut self.held),
                stopped: true,
            };
        }
        let keep = self.longest_stop_prefix_suffix();
        let emit = self.held[..self.held.len() - keep].to_string();
        self.held.drain(..self.held.len() - keep);
        Pushed {
            emit,
            stopped: false,
        }
    }

    /// The text still held back when generation ends without a stop string.
    pub fn finish(self) -> String {
        self.held
    }

    /// Length in bytes of the longest end of the held text that is the
    /// start of a stop string (always at a character boundary).
    fn longest_stop_prefix_suffix(&self) -> usize {
        let held = self.held.as_str();
        (1..=held.len())
            .rev()
            .filter(|&n| held.is_char_boundary(held.len() - n))
            .find(|&n| {
                let tail = &held[held.len() - n..];
                self.stops.iter().any(|s| s.starts_with(tail))
            })
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut s = StopStrings::new(stops.iter().map(|s| (*s).to_string()).collect());
        let mut out = String::new();
        for piece in pieces {
            let p = s.push(piece);
            out.push_str(&p.emit);
            if p.stopped {
                return (out, true);
            }
        }
        out.push_str(&s.finish());
        (out, false)
    }

    #[test]
    fn a_stop_string_split_across_pieces_ends_the_text_before_it() {
        assert_eq!(
            run(&["\n\nUser:"], &["Hi.", "\n", "\nUser:", " more"]),
            ("Hi.".into(), true)
        );
        assert_eq!(run(&["END"], &["abcE", "N", "Dxyz"]), ("abc".into(), true));
    }

    #[test]
    fn a_false_start_is_released_when_the_text_moves_on() {
        let mut s = StopStrings::new(vec!["END".into()]);
        assert_eq!(s.push("abE").emit, "ab");
        assert_eq!(s.push("x").emit, "Ex");
        assert_eq!(run(&["END"], &["ab", "EN"]), ("abEN".into(), false));
    }

    #[test]
    fn the_earliest_of_several_stop_strings_wins() {
        assert_eq!(run(&["b", "a"], &["xyab"]), ("xy".into(), true));
    }

    #[test]
    fn multibyte_text_is_held_at_character_boundaries() {
        assert_eq!(run(&["é!"], &["caf", "é", "?"]), ("café?".into(), false));
        assert_eq!(run(&["é!"], &["café", "!"]), ("caf".into(), true));
    }
}
