import unittest

from minidjango.validators import (
    ASCIIUsernameValidator,
    MinimumLengthValidator,
    UnicodeUsernameValidator,
    ValidationError,
)


class MinimumLengthValidatorTest(unittest.TestCase):
    def test_validate(self):
        MinimumLengthValidator().validate("12345678")
        with self.assertRaises(ValidationError):
            MinimumLengthValidator().validate("1234567")


class UsernameValidatorsTests(unittest.TestCase):
    def check(self, validator, valid_usernames, invalid_usernames):
        for valid in valid_usernames:
            validator(valid)
        for invalid in invalid_usernames:
            with self.assertRaises(ValidationError, msg=repr(invalid)):
                validator(invalid)

    def test_unicode_validator(self):
        valid_usernames = ["joe", "René", "ᴮᴵᴳᴮᴵᴿᴰ", "أحمد"]
        invalid_usernames = ["o'connell", "عبد ال", "zerowidth\u200bspace", "nonbreaking\u00a0space", "en\u2013dash"]
        self.check(UnicodeUsernameValidator(), valid_usernames, invalid_usernames)

    def test_ascii_validator(self):
        valid_usernames = ["glenn", "GLEnN", "jean-marc"]
        invalid_usernames = ["o'connell", "Éric", "jean marc", "أحمد"]
        self.check(ASCIIUsernameValidator(), valid_usernames, invalid_usernames)
