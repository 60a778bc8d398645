"""The one tie rule (golden.ties): selections equal up to exactly tied scores are equivalent and
adopted; any difference in a score is not.  Golden's own order is the documented stable one."""
import numpy as np

from golden.ties import adopt_equivalent, equivalent_rows


def test_golden_order_is_descending_with_ties_to_the_lower_index():
    s = np.zeros(10)
    s[[1, 8]] = [1.0, 2.0]
    assert np.argsort(-s, kind="stable")[:4].tolist() == [8, 1, 0, 2]


def test_selections_differing_only_among_exact_ties_are_equivalent():
    s = np.array([[3.0, 0.0, 1.0, 0.0, 0.0, -np.inf],
                  [3.0, 0.0, 1.0, 0.0, 0.0, -np.inf],
                  [3.0, 0.0, 1.0, 0.0, 1e-12, -np.inf],
                  [3.0, 0.0, 1.0, 0.0, 0.0, -np.inf],
                  [3.0, 0.0, 1.0, 0.0, 0.0, -np.inf]])
    golden = np.array([[0, 2, 1, -1], [0, 2, 1, -1], [0, 2, 4, -1], [0, 2, 1, -1], [0, 2, 1, -1]])
    other = np.array([[2, 0, 4, -1],       # another zero: equivalent
                      [0, 2, 1, -1],       # the same set in the same order
                      [0, 2, 1, -1],       # 1e-12 is not a tie with 0: a divergence
                      [0, 2, -1, -1],      # one fewer selected
                      [0, 1, 3, -1]])      # drops the 1.0 for a zero
    np.testing.assert_array_equal(equivalent_rows(s, golden, other), [True, True, False, False, False])
    chosen, rows = adopt_equivalent(s, golden, other)
    assert rows.tolist() == [0]
    np.testing.assert_array_equal(chosen[0], other[0])
    np.testing.assert_array_equal(chosen[1:], golden[1:])
    # -0.0 and 0.0 are the same score; an out-of-range or repeated index is never equivalent
    z = np.array([[1.0, 0.0, -0.0]])
    assert equivalent_rows(z, np.array([[0, 1]]), np.array([[0, 2]])).tolist() == [True]
    assert equivalent_rows(z, np.array([[0, 1]]), np.array([[0, 3]])).tolist() == [False]
    assert equivalent_rows(z, np.array([[0, 1]]), np.array([[1, 1]])).tolist() == [False]
    assert equivalent_rows(z, np.array([[0, 1]]), np.array([[0, 1, 2]])).tolist() == [False]
