//! The prefix trie shared across conversations.
