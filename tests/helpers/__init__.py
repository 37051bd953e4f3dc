"""Code the test modules share: models and their inputs, cases, reference checks. Test modules
import it as ``tests.helpers.<module>`` and never import one another (tests/test_suite_wiring.py)."""
