"""The algorithm: draft trees and their buffers, acceptance rules, tree-choosing policies and their
signals, and the decode loop that joins them (read tree, acceptance, policy, then loop). No Ray, no files."""
