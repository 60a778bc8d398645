"""The tie rules (golden.ties): selections equal up to exactly tied scores are equivalent and
adopted; any difference in a score is not.  Golden's own order is the documented stable one.  The
indexer's near tie: the other side's weakest row within INDEX_TIE_TOL of one's own weakest,
relative to the largest selected |score|, on NumPy and on JAX alike."""
import numpy as np

from golden.ties import INDEX_TIE_TOL, adopt_equivalent, equivalent_rows, index_gaps, index_near_ties


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


def _index_case():
    """Scores of 6 candidates, largest |score| selected 10 (scale 10): the near-tie margin is 1.0."""
    s = np.array([[10.0, 6.0, 5.0, 4.5, 3.9, -3.4e38]] * 6)
    mine = np.array([[0, 1, 2, -1]] * 6)                 # weakest selected: 5.0
    theirs = np.array([[0, 1, 3, -1],      # 4.5: gap 0.05, a near tie
                       [0, 1, 4, -1],      # 3.9: gap 0.11, beyond 0.1
                       [2, 1, 0, -1],      # the same rows in another order: not a difference
                       [0, 1, -1, -1],     # one fewer selected: not comparable
                       [0, 1, 5, -1],      # a masked candidate: far beyond
                       [0, 1, 6, -1]])     # past C: not comparable
    return s, mine, theirs


def test_index_near_tie_is_relative_to_the_largest_selected_score():
    s, mine, theirs = _index_case()
    gaps = index_gaps(s, mine, theirs)
    np.testing.assert_allclose(gaps[:2], [0.05, 0.11], rtol=1e-12)
    assert np.isnan(gaps[[2, 3, 5]]).all() and gaps[4] > 1e30
    assert index_near_ties(s, mine, theirs).tolist() == [True, False, False, False, False, False]
    # the margin is a parameter of the rule (the lockstep sets its own); the scale is at least 1
    assert index_near_ties(s, mine, theirs, tol=0.12).tolist() == [True, True, False, False, False, False]
    small = np.array([[0.5, 0.2, 0.1]])
    np.testing.assert_allclose(index_gaps(small, np.array([[0, 1]]), np.array([[0, 2]])), [0.1], rtol=1e-12)
    assert INDEX_TIE_TOL == 0.1


def test_index_near_tie_rule_is_the_same_on_jax():
    """The JAX path's form of the rule (traced, f32 scores) gives the same rows."""
    import jax
    import jax.numpy as jnp
    s, mine, theirs = _index_case()
    with jax.enable_x64(True):
        got = jax.jit(lambda a, b, c: index_near_ties(a, b, c, xp=jnp))(
            jnp.asarray(s, jnp.float32), jnp.asarray(mine), jnp.asarray(theirs))
    assert np.asarray(got).tolist() == index_near_ties(s, mine, theirs).tolist()
